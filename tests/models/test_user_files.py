"""The one checked opener of user-named files (models/loading/user_files.py, issue 71): a FIFO, a
device, a directory, a link out of the named folder, a file over its cap, JSON nested past the
recursion limit or not an object are refused by name at once (never a hang); a Hugging Face cache
snapshot's links into its blobs are followed; checkpoints, tokenizers and chat templates read
through it."""

from __future__ import annotations

import os

import pytest

from pagedjax.models.loading.user_files import checked_path, read_user_bytes, read_user_json

pytestmark = pytest.mark.timeout(60)  # a FIFO opened the blocking way would hang here


def test_what_is_not_a_regular_file_is_refused(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "fifo", tmp_path / "to-fifo")
    for path, says in [(tmp_path / "fifo", "is a FIFO"), (tmp_path / "to-fifo", "is a FIFO"),
                       ("/dev/zero", "is a device"), (tmp_path, "is a directory"),
                       (tmp_path / "missing", "could not be read")]:
        with pytest.raises(ValueError, match=says):
            read_user_bytes(path, "config")
        with pytest.raises(ValueError, match=says):
            checked_path(path, "config")


def test_links_out_caps_and_json(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "secret.json").write_text('{"a": 1}')
    os.symlink(tmp_path / "secret.json", tmp_path / "model" / "config.json")
    with pytest.raises(ValueError, match="a link out of"):
        read_user_json(tmp_path / "model" / "config.json", root=str(tmp_path / "model"))
    assert read_user_json(tmp_path / "model" / "config.json") == {"a": 1}  # no root: followed
    # a Hugging Face cache snapshot: files link into the repository's blobs
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "blobs" / "f00").write_text('{"b": 2}')
    os.symlink("../../blobs/f00", repo / "snapshots" / "abc" / "config.json")
    assert read_user_json(repo / "snapshots" / "abc" / "config.json",
                          root=str(repo / "snapshots" / "abc")) == {"b": 2}
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: nothing is read to refuse it
    with pytest.raises(ValueError, match="is 1073741824 bytes, over the 1000-byte limit"):
        read_user_bytes(big, "file", max_bytes=1000)
    exact = tmp_path / "exact"
    exact.write_bytes(b"x" * 1000)
    assert read_user_bytes(exact, "file", max_bytes=1000) == b"x" * 1000  # at the cap: read
    with pytest.raises(ValueError, match="over the 999-byte limit"):
        read_user_bytes(exact, "file", max_bytes=999)
    with pytest.raises(ValueError, match="reading took over 1e-09 s"):
        read_user_bytes(exact, "file", timeout_s=1e-9)  # a stalled mount: bounded
    for text, says in [("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                       ("[1]", "must hold a JSON object, not a list"),
                       ("{", "is not valid JSON")]:
        (tmp_path / "c.json").write_text(text)
        with pytest.raises(ValueError, match=says):
            read_user_json(tmp_path / "c.json")
    (tmp_path / "modules.json").write_text('{"not": "a list"}')  # sentence-transformers'
    with pytest.raises(ValueError, match="must hold a JSON array, not a dict"):
        read_user_json(tmp_path / "modules.json", kind=list)
    (tmp_path / "modules.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        read_user_json(tmp_path / "modules.json", kind=list)


def test_checkpoints_and_tokenizers_read_through_it(tmp_path):
    from pagedjax.models.loading.hf import load_hf_model, read_hf_config
    from pagedjax.text.tokenizer import Tokenizer, read_chat_template
    (tmp_path / "ckpt").mkdir()
    os.mkfifo(tmp_path / "ckpt" / "config.json")
    with pytest.raises(ValueError, match="config.json .* is a FIFO"):
        read_hf_config(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="is a FIFO"):
        load_hf_model(str(tmp_path / "ckpt"))
    (tmp_path / "tok").mkdir()
    from tokenizers import Tokenizer as RustTokenizer, models
    RustTokenizer(models.WordLevel({"a": 0}, unk_token="a")).save(
        str(tmp_path / "tok" / "tokenizer.json"))
    os.mkfifo(tmp_path / "tok" / "tokenizer_config.json")
    with pytest.raises(ValueError, match="tokenizer_config.json .* is a FIFO"):
        Tokenizer.from_dir(str(tmp_path / "tok"))
    from pagedjax.models.loading.gguf import open_gguf
    os.mkfifo(tmp_path / "model.gguf")
    with pytest.raises(ValueError, match="GGUF file .* is a FIFO"):
        open_gguf(str(tmp_path / "model.gguf"))
    os.mkfifo(tmp_path / "template.jinja")
    os.symlink(tmp_path / "template.jinja", tmp_path / "link.jinja")
    (tmp_path / "real.jinja").write_text("{{ messages }}")
    assert read_chat_template(str(tmp_path / "real.jinja")) == "{{ messages }}"
    with pytest.raises(ValueError, match="is neither a file"):  # a FIFO is not a file
        read_chat_template(str(tmp_path / "link.jinja"))
