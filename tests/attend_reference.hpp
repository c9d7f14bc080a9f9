// The reference of attend: softmax attention in double over K and V as kvforge's own dequantizing gather
// returns them, by plain loops over logical coordinates (no online softmax, no splits, no tiles). The
// tests of every variant (test_attend.cpp) hold Cache::attend to it.
#pragma once

#include <cmath>
#include <limits>
#include <vector>

namespace kvtest {

// One query row over the positions [lo, hi) of its sequence. key(j) and value(j) return position j's
// row (key width and value width floats). Scores are scale * q.k, soft-capped where softcap > 0; a sink
// joins the denominator only.
struct AttendRow {
  std::vector<double> out;
  double lse = -std::numeric_limits<double>::infinity();
};

template <class Key, class Value>
AttendRow attend_reference(const std::vector<float>& q, int64_t lo, int64_t hi, Key key, Value value, int value_width,
                           double scale, double softcap, bool has_sink, double sink) {
  std::vector<double> scores;
  double top = has_sink ? sink : -std::numeric_limits<double>::infinity();
  for (int64_t j = lo; j < hi; ++j) {
    const float* k = key(j);
    double s = 0;
    for (size_t e = 0; e < q.size(); ++e) s += double(q[e]) * double(k[e]);
    s *= scale;
    if (softcap > 0) s = softcap * std::tanh(s / softcap);
    scores.push_back(s);
    top = std::max(top, s);
  }
  AttendRow row;
  row.out.assign(size_t(value_width), 0.0);
  double sum = has_sink ? std::exp(sink - top) : 0.0;
  for (int64_t j = lo; j < hi; ++j) {
    const double w = std::exp(scores[size_t(j - lo)] - top);
    sum += w;
    const float* v = value(j);
    for (int e = 0; e < value_width; ++e) row.out[size_t(e)] += w * double(v[e]);
  }
  for (double& o : row.out) o /= sum;
  row.lse = top + std::log(sum);
  return row;
}

}  // namespace kvtest
