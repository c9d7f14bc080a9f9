"""The spec loader against hostile and broken input: every case gives `file:line: field: problem`, on
the command line as in the library, never a traceback, a hang or a partial output."""

import os
import subprocess
import sys
import tempfile
import unittest

from kvforge_codegen import vocab
from kvforge_codegen.diagnostics import SpecFailure
from kvforge_codegen.validate import load_specs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(REPO, "specs", "models")

from test_codegen import GOOD_LAYOUT  # tests/codegen is on the path under unittest discover


def good(name: str) -> bytes:
    return GOOD_LAYOUT.format(name=name).encode()


def alias_bomb(levels: int = 9) -> bytes:
    """Each level refers to the one before nine times: 9**levels nodes once expanded."""
    lines = [b"name: bomb", b"a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        refs = b", ".join([b"*a%d" % (i - 1)] * 9)
        lines.append(b"a%d: &a%d [%s]" % (i, i, refs))
    return b"\n".join(lines) + b"\n"


class Files:
    """A temporary tree with layouts/ and models/ folders."""

    def __init__(self, layouts=None, models=None):
        self.tmp = tempfile.TemporaryDirectory()
        self.root = self.tmp.name
        self.layouts = os.path.join(self.root, "layouts")
        self.models = os.path.join(self.root, "models")
        for folder, files in ((self.layouts, layouts or {}), (self.models, models or {})):
            os.makedirs(folder)
            for name, data in files.items():
                with open(os.path.join(folder, name), "wb") as f:
                    f.write(data)

    def errors(self, models=None):
        try:
            load_specs([self.layouts], models or [MODELS], self.root)
        except SpecFailure as failure:
            return [str(e) for e in failure.errors]
        return []

    def close(self):
        self.tmp.cleanup()


def errors_of(data: bytes, name: str = "bad.yaml"):
    files = Files({name: data})
    try:
        return files.errors()
    finally:
        files.close()


class HostileBytes(unittest.TestCase):
    def test_bytes_that_are_not_utf8(self):
        self.assertEqual(errors_of(b"name: bad\naddressing: \xff\xfepaged\n"), [
            "layouts/bad.yaml:2: (file): byte 0xff at offset 22 is not UTF-8 (allowed: UTF-8 text)"])

    def test_control_characters(self):
        self.assertEqual(errors_of(b"name: bad\nupdate: a\x00b\n"), [
            "layouts/bad.yaml:2: (yaml): not valid YAML: special characters are not allowed"])

    def test_alias_bomb_is_refused_at_its_first_anchor(self):
        self.assertEqual(errors_of(alias_bomb()), [
            "layouts/bad.yaml:2: a0: anchors (&name) and aliases (*name) are not allowed in specs "
            "(allowed: values written out in full)"])

    def test_self_referencing_alias(self):
        self.assertEqual(errors_of(b"name: bad\nx: &a [*a]\n"), [
            "layouts/bad.yaml:2: x: anchors (&name) and aliases (*name) are not allowed in specs "
            "(allowed: values written out in full)"])

    def test_lists_nested_very_deep(self):
        deep = b"name: bad\nexpand: " + b"[" * 20000 + b"]" * 20000 + b"\n"
        self.assertEqual(errors_of(deep), [
            f"layouts/bad.yaml:2: expand: nested more than {vocab.MAX_SPEC_DEPTH} levels deep "
            f"(allowed: at most {vocab.MAX_SPEC_DEPTH} levels)"])

    def test_a_file_over_the_size_limit(self):
        big = good("bad") + b"".join(b"# padding line %d\n" % i for i in range(600000))
        self.assertEqual(errors_of(big), [
            f"layouts/bad.yaml:1: (file): larger than {vocab.MAX_SPEC_BYTES} bytes; a spec is a short file "
            f"(allowed: at most {vocab.MAX_SPEC_BYTES} bytes)"])

    def test_too_many_values_within_the_size_limit(self):
        many = b"name: bad\nx: [" + b",".join([b"1"] * (vocab.MAX_SPEC_NODES + 10)) + b"]\n"
        self.assertLessEqual(len(many), vocab.MAX_SPEC_BYTES)
        self.assertEqual(errors_of(many), [
            f"layouts/bad.yaml:2: (document): more than {vocab.MAX_SPEC_NODES} values; a spec is far smaller "
            f"(allowed: at most {vocab.MAX_SPEC_NODES} values)"])

    def test_a_second_document(self):
        self.assertEqual(errors_of(good("bad") + b"---\nname: other\n"), [
            "layouts/bad.yaml:9: (document): a spec file holds one YAML document; found a second "
            "(allowed: one document, no '---' after the first)"])

    def test_keys_that_are_not_names_and_odd_tags(self):
        text = good("bad").replace(b"update: eager\n", b"update: !!binary aGVsbG8=\n? [a, b]\n: 1\n")
        self.assertEqual(errors_of(text), [
            "layouts/bad.yaml:5: update: unknown value 'aGVsbG8=' (allowed: eager, lazy)",
            "layouts/bad.yaml:6: (document): keys must be plain names"])

    def test_a_huge_integer(self):
        text = good("bad").replace(b"page_size: 16", b"page_size: " + b"9" * 5000)
        self.assertEqual(errors_of(text), [
            "layouts/bad.yaml:3: page_size: expected a positive integer, got '" + "9" * 36 + "... (allowed: 1..4096)"])

    def test_an_empty_file_and_a_folder_named_like_a_spec(self):
        files = Files({"empty.yaml": b""})
        os.makedirs(os.path.join(files.layouts, "dir.yaml"))
        try:
            errors = files.errors()
        finally:
            files.close()
        self.assertEqual(len(errors), 2)
        self.assertTrue(errors[0].startswith("layouts/dir.yaml:1: (file): cannot read: "), errors)
        self.assertEqual(errors[1], "layouts/empty.yaml:1: (document): the file is empty")


class Messages(unittest.TestCase):
    def test_every_refused_number_states_its_range(self):
        for written, shown in ((b"0", "0"), (b"-16", "-16"), (b"sixteen", "'sixteen'"), (b"1.5", "1.5"),
                               (b"[16]", "a list"), (b"true", "True")):
            text = good("bad").replace(b"page_size: 16", b"page_size: " + written)
            self.assertEqual(errors_of(text), [
                f"layouts/bad.yaml:3: page_size: expected a positive integer, got {shown} (allowed: 1..4096)"],
                written)

    def test_model_numbers_state_their_ranges(self):
        model = b"name: huge\nlayers: 100000\nkv_heads: 0\nhead_dim: 128\nmax_seq_len: 64\n"
        files = Files({"mine.yaml": good("mine").replace(b"[tiny]", b"[huge]")}, {"huge.yaml": model})
        try:
            errors = files.errors([files.models])
        finally:
            files.close()
        # One root cause, one error each: the layout that names the refused model says nothing more.
        self.assertEqual(errors, [
            f"models/huge.yaml:2: layers: 100000 is too large (allowed: 1..{vocab.MAX_LAYERS})",
            f"models/huge.yaml:3: kv_heads: expected a positive integer, got 0 (allowed: 1..{vocab.MAX_KV_HEADS})"])

    def test_a_model_that_does_not_exist_is_still_unknown(self):
        errors = errors_of(good("bad").replace(b"[tiny]", b"[nonesuch]"))
        self.assertEqual(len(errors), 1)
        self.assertTrue(errors[0].startswith("layouts/bad.yaml:7: expand[0].models: unknown model 'nonesuch' (allowed: "))


class CommandLine(unittest.TestCase):
    """Through the command line: exit 1, diagnostics only, nothing written, quickly."""

    def test_hostile_files_together(self):
        files = Files({"bomb.yaml": alias_bomb(12), "bytes.yaml": b"\x80\x81\x82", "ok.yaml": good("ok"),
                       "deep.yaml": b"name: deep\nx: " + b"{a: " * 5000 + b"1" + b"}" * 5000 + b"\n"})
        out = os.path.join(files.root, "out")
        try:
            env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "codegen"))
            r = subprocess.run([sys.executable, "-m", "kvforge_codegen", "generate", "--layouts", files.layouts,
                                "--models", MODELS, "--source-root", files.root, "--out", out],
                               capture_output=True, text=True, env=env, timeout=60)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertNotIn("Traceback", r.stderr)
            self.assertFalse(os.path.exists(out))
            lines = r.stderr.splitlines()
            self.assertEqual([line.split(":")[0] for line in lines[:-1]],
                             ["layouts/bomb.yaml", "layouts/bytes.yaml", "layouts/deep.yaml"])
            self.assertEqual(lines[-1], "kvforge-codegen: 3 error(s) in the specs; nothing was written")
        finally:
            files.close()


if __name__ == "__main__":
    unittest.main()
