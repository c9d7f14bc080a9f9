// The consumer's own float code, built with the consumer's flags only. Under -fno-trapping-math GCC -O3
// folds float(int(c)) into truncf(c), which keeps the sign of -0.5 (giving -0.0, not 0.0): if kvforge's
// options leaked into this file, main() would see it.
float through_int(float c) { return float(int(c)); }
