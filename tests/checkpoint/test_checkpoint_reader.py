"""Reading model directories: tensors come as stored, MTP bytes are read only on request, broken ones fail clearly."""

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds4.checkpoint import reader
from ds4.checkpoint.reader import CheckpointError, ReadStats, detect_format, load_checkpoint
from ds4.checkpoint.tiny import make_tiny
from ds4.config import load_config

SMALL = {"vocab_size": 1000}
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def official_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("official"), "official", seed=3, config_overrides=SMALL)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("hf"), "hf", seed=3, config_overrides=SMALL)


@pytest.fixture
def broken(official_dir, tmp_path):
    """A private copy of the official checkpoint to damage."""
    return shutil.copytree(official_dir, tmp_path / "ckpt", ignore=shutil.ignore_patterns("tokenizer*"))


def load(path, **kw):
    return dict(load_checkpoint(path, progress=False, **kw))


def same(a, b):
    """Equal dtype, shape and bytes (float8 tensors compare by their bytes)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def weight_map(path):
    return json.loads((path / INDEX).read_text())["weight_map"]


def rewrite(path, edit):
    """Apply edit(name -> tensor dict of one shard, shard name) to every shard and rewrite shards and index."""
    index = json.loads((path / INDEX).read_text())
    new_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(path / shard)
        edit(tensors, shard)
        save_file(tensors, path / shard)
        new_map.update({name: shard for name in tensors})
    index["weight_map"] = new_map
    (path / INDEX).write_text(json.dumps(index))


def header_ranges(path, shard):
    """name -> absolute [begin, end) byte range of its data, parsed from the safetensors header by hand."""
    raw = (path / shard).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return {
        k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__"
    }


class SpyFile:
    """A file proxy that logs every byte range read."""

    def __init__(self, f, log):
        self._f, self._log = f, log
        self.name = f.name

    def read(self, n=-1):
        start = self._f.tell()
        data = self._f.read(n)
        self._log.append((start, start + len(data)))
        return data

    def readinto(self, buffer):
        start = self._f.tell()
        n = self._f.readinto(buffer)
        self._log.append((start, start + n))
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.fixture
def spy_open(monkeypatch):
    """Record, per shard file name, how often it was opened and which byte ranges were read."""
    opened, reads = {}, {}

    def spying_open(path, mode="r", *args, **kw):
        f = open(path, mode, *args, **kw)
        name = str(path).rsplit("/", 1)[-1]
        opened[name] = opened.get(name, 0) + 1
        return SpyFile(f, reads.setdefault(name, []))

    monkeypatch.setattr(reader, "open", spying_open, raising=False)
    return opened, reads


def overlaps(ranges, begin, end):
    return any(a < end and begin < b for a, b in ranges)


def covered(ranges, begin, end):
    return sum(max(0, min(b, end) - max(a, begin)) for a, b in ranges) >= end - begin


@pytest.mark.parametrize("with_mtp", [False, True])
def test_mtp_bytes_are_read_only_on_request_in_one_pass(official_dir, spy_open, with_mtp):
    opened, reads = spy_open
    stats = ReadStats()
    state = load(official_dir, with_mtp=with_mtp, stats=stats)
    wmap = weight_map(official_dir)
    shards = sorted(set(wmap.values()))
    mtp_shards = {s for s in shards if all(n.startswith("mtp.") for n, f in wmap.items() if f == s)}
    assert mtp_shards and any(n.startswith("mtp.") for n, f in wmap.items() if f not in mtp_shards)
    assert all(count == 1 for count in opened.values())
    assert set(opened) == (set(shards) if with_mtp else set(shards) - mtp_shards)
    for shard in opened:
        for name, (begin, end) in header_ranges(official_dir, shard).items():
            if name.startswith("mtp.") and not with_mtp:
                assert not overlaps(reads[shard], begin, end), name
            else:
                assert covered(reads[shard], begin, end), name
    assert any(n.startswith("mtp.") for n in state) == with_mtp
    assert any(n.startswith("mtp.") for n in stats.bytes_read) == with_mtp
    assert set(stats.shards_opened) == set(opened)


def test_tensors_come_as_stored(official_dir, hf_dir):
    assert detect_format(official_dir) == "official" and detect_format(hf_dir) == "hf"
    state = load(official_dir, with_mtp=True)
    wmap = weight_map(official_dir)
    assert state.keys() == wmap.keys()
    for name in (
        "layers.1.attn.wq_b.weight",
        "layers.1.attn.wq_b.scale",
        "layers.2.ffn.experts.3.w1.weight",
        "layers.2.ffn.experts.3.w1.scale",
        "mtp.0.h_proj.weight",
        "norm.weight",
        "layers.0.ffn.gate.tid2eid",
        "layers.0.hc_attn_fn",
    ):
        assert same(state[name], load_file(official_dir / wmap[name])[name]), name
    hf = load(hf_dir, config=load_config(official_dir), with_mtp=True)
    assert hf.keys() == {n for n in state if not n.endswith(".scale")}
    assert hf["layers.1.attn.wq_b.weight"].dtype == torch.bfloat16


def test_data_is_read_only_while_iterating_but_problems_raise_at_once(official_dir, broken, spy_open):
    opened, reads = spy_open
    stream = load_checkpoint(official_dir, progress=False)
    assert opened
    for shard in opened:
        for name, (begin, end) in header_ranges(official_dir, shard).items():
            assert not overlaps(reads[shard], begin, end), name
    first, tensor = next(stream)
    stream.close()
    assert tensor.numel() > 0
    (broken / weight_map(broken)["norm.weight"]).write_bytes(b"\0" * 4)
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(broken, progress=False)


def test_single_file_checkpoint_without_index(official_dir, broken):
    tensors = {}
    for shard in sorted(set(weight_map(broken).values())):
        tensors.update(load_file(broken / shard))
        (broken / shard).unlink()
    (broken / INDEX).unlink()
    save_file(tensors, broken / "model.safetensors")
    a, b = load(official_dir), load(broken)
    assert a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def expect_error(path, *fragments, **kw):
    with pytest.raises(CheckpointError) as info:
        load(path, **kw)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    return message


def test_missing_tensor(broken):
    rewrite(broken, lambda t, s: t.pop("layers.2.attn.wkv.weight", None))
    expect_error(broken, "missing tensors (1)", "layers.2.attn.wkv.weight")


def test_unexpected_tensor(broken):
    def add(tensors, shard):
        if "norm.weight" in tensors:
            tensors["layers.0.attn.bogus.weight"] = torch.zeros(3)

    rewrite(broken, add)
    expect_error(broken, "unexpected tensors (1)", "layers.0.attn.bogus.weight")


def test_wrong_shape(broken):
    def shrink(tensors, shard):
        if "layers.0.attn.attn_sink" in tensors:
            tensors["layers.0.attn.attn_sink"] = torch.zeros(5)

    rewrite(broken, shrink)
    expect_error(broken, "layers.0.attn.attn_sink: shape [5], expected [4]")


def test_wrong_dtypes(broken):
    def retype(tensors, shard):
        if "layers.0.attn.wq_a.weight" in tensors:
            tensors["layers.0.attn.wq_a.weight"] = tensors["layers.0.attn.wq_a.weight"].to(torch.bfloat16)
            tensors["layers.0.hc_ffn_base"] = tensors["layers.0.hc_ffn_base"].to(torch.bfloat16)

    rewrite(broken, retype)
    expect_error(
        broken,
        "layers.0.attn.wq_a.weight: dtype bfloat16, expected float8_e4m3fn",
        "layers.0.hc_ffn_base: dtype bfloat16, expected float32",
    )


def test_truncated_shard(broken):
    shard = broken / weight_map(broken)["layers.3.attn.wq_a.weight"]
    shard.write_bytes(shard.read_bytes()[:-100])
    expect_error(broken, f"shard {shard.name}: truncated")


def test_corrupt_header(broken):
    shard = broken / weight_map(broken)["embed.weight"]
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xfe{x"
    shard.write_bytes(bytes(data))
    expect_error(broken, f"shard {shard.name}: corrupt safetensors header")


def test_index_points_at_missing_shard(broken):
    shard = weight_map(broken)["layers.3.attn.wq_a.weight"]
    (broken / shard).unlink()
    expect_error(broken, f"shard {shard} (listed in the index", "does not exist")


def test_index_disagrees_with_shard_header(broken):
    index = json.loads((broken / INDEX).read_text())
    first, other = sorted(set(index["weight_map"].values()))[:2]
    index["weight_map"]["norm.weight"] = other
    (broken / INDEX).write_text(json.dumps(index))
    expect_error(broken, f"norm.weight: the index places it in {other}, whose header does not list it")


def test_every_problem_is_listed_in_one_error(broken):
    def damage(tensors, shard):
        tensors.pop("layers.1.attn.indexer.wq_b.weight", None)
        if "head.weight" in tensors:
            tensors["head.weight"] = tensors["head.weight"][:10]

    rewrite(broken, damage)
    message = expect_error(
        broken, "layers.1.attn.indexer.wq_b.weight", "head.weight: shape [10, 64], expected [1000, 64]"
    )
    assert message.count("\n  - ") == 2


def test_mtp_problems_matter_only_with_mtp(broken):
    rewrite(broken, lambda t, s: t.pop("mtp.0.e_proj.weight", None))
    assert not any(n.startswith("mtp.") for n in load(broken))
    expect_error(broken, "mtp.0.e_proj.weight", with_mtp=True)


def test_no_checkpoint_files(tmp_path, official_dir):
    shutil.copy(official_dir / "config.json", tmp_path / "config.json")
    expect_error(tmp_path, "no model.safetensors.index.json or model.safetensors")
