"""nanoserve's GGUF header reader (model/gguf_file.py) against gguf-py's GGUFReader: the same
fields (values, Python types and GGUF value types) and the same tensors (name, type, shape,
offset, size and data, viewed as gguf-py views it), on the embedded SmolLM2 file (49,152
strings of vocabulary) and on a file gguf-py writes with every value type, a nested array,
a non-default alignment and tensors typed and in blocks; and a broken file refused with
what is wrong with it."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from nanoserve.model.gguf import open_gguf
from nanoserve.model.gguf_file import GGUFFile, read_gguf
from nanoserve.model.loader import embedded_gguf_path

VT = gguf.GGUFValueType


def assert_same_as_gguf_py(path: Path) -> GGUFFile:
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        want = field.contents()
        assert ours.metadata[key] == want, key
        assert type(ours.metadata[key]) is type(want), key
        main = field.types[0]
        assert ours.types[key] == (main, field.types[-1] if main == VT.ARRAY else None), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, tuple(int(d) for d in b.shape), b.n_bytes, b.data_offset)
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), a.name
        assert np.array_equal(a.data, b.data), a.name
    return ours


def test_the_embedded_model_reads_as_gguf_py_reads_it() -> None:
    header = assert_same_as_gguf_py(embedded_gguf_path())
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(header.tensors) == 272


def write_every_type(path: Path, *, alignment: int = 64) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(alignment)
    for i, (vtype, value) in enumerate([
            (VT.UINT8, 200), (VT.INT8, -100), (VT.UINT16, 60000), (VT.INT16, -30000),
            (VT.UINT32, 4_000_000_000), (VT.INT32, -2_000_000_000), (VT.FLOAT32, 0.1),
            (VT.BOOL, True), (VT.STRING, "héllo, 世界 🙂"), (VT.UINT64, 2**63 + 5),
            (VT.INT64, -(2**62)), (VT.FLOAT64, 1e-300)]):
        w.add_key_value(f"t.scalar{i}", value, vtype)
    w.add_key_value("t.strings", ["", "a", "é", "🙂" * 40], VT.ARRAY, sub_type=VT.STRING)
    w.add_key_value("t.floats", [0.5, -1.25, 3e38], VT.ARRAY, sub_type=VT.FLOAT32)
    w.add_key_value("t.bools", [True, False, True], VT.ARRAY, sub_type=VT.BOOL)
    w.add_key_value("t.ints", [-1, 2**40], VT.ARRAY, sub_type=VT.INT64)
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 5), dtype=np.float32))
    w.add_tensor("b.weight", rng.standard_normal((4, 64)).astype(np.float16))
    w.add_tensor("c.weight", np.arange(7, dtype=np.int8))
    q = gguf.quants.quantize(rng.standard_normal((2, 64), dtype=np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("d.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_and_tensor_kind_reads_as_gguf_py_reads_it(tmp_path: Path) -> None:
    header = assert_same_as_gguf_py(write_every_type(tmp_path / "all.gguf"))
    assert header.metadata["general.alignment"] == 64
    assert all(t.data_offset % 64 == 0 for t in header.tensors)
    assert header.metadata["t.scalar8"] == "héllo, 世界 🙂"
    assert header.types["t.strings"] == (VT.ARRAY, VT.STRING)
    assert header.tensors[3].data.shape == (2, 68)  # Q8_0: two blocks of 34 bytes a row


def test_nested_arrays_read_as_lists_of_lists(tmp_path: Path) -> None:
    # gguf-py writes arrays of arrays but its reader flattens them; GGUF nests them
    w = gguf.GGUFWriter(str(tmp_path / "n.gguf"), "llama")
    w.add_key_value("t.nested", [[1, 2], [3]], VT.ARRAY, sub_type=VT.ARRAY)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert read_gguf(tmp_path / "n.gguf").metadata["t.nested"] == [[1, 2], [3]]


@pytest.mark.parametrize(("cut", "why"), [
    (lambda b: b"not a model\n", "(GGUF magic invalid)"),
    (lambda b: b[:200], "(the header runs past the file's end (200 bytes))"),
    (lambda b: b[:-100], "(truncated: tensor d.weight ends at byte"),
    (lambda b: b[:4] + b"\x01\x00\x00\x00" + b[8:], "(GGUF version 1; this reader takes 2 and 3)"),
    (lambda b: b[:4] + b"\x00\x00\x00\x03" + b[8:],
     "(a big-endian GGUF, which this reader does not take)"),
    (lambda b: b.replace(b"\x08\x00\x00\x00\x00\x00\x00\x00b.weight",
                         b"\x08\x00\x00\x00\x00\x00\x00\x00a.weight"),
     "(tensor a.weight twice)"),
    (lambda b: b.replace(b"alignment\x04\x00\x00\x00\x40", b"alignment\x04\x00\x00\x00\x30"),
     "(general.alignment 48 is not a power of two)"),
], ids=["text", "header-cut", "data-cut", "version-1", "big-endian", "twice", "alignment"])
def test_a_broken_file_is_refused_with_what_is_wrong(cut: Callable[[bytes], bytes], why: str,
                                                     tmp_path: Path) -> None:
    whole = write_every_type(tmp_path / "all.gguf").read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(cut(whole))
    assert broken.read_bytes() != whole
    with pytest.raises(ValueError, match="^" + re.escape(
            f"{broken}: not a readable GGUF file, truncated or corrupt {why}")):
        open_gguf(broken)
