"""A model flag takes a folder or a hub id already in the local Hugging Face cache (tether.shared.model_source):
found offline at its revision, nothing downloaded; one typed refusal when it is not cached."""

import json
import os
import subprocess
import sys

import pytest
from hub_cache import cache_hub_model

from tether.shared.cli_support import TARGET_FILES, CommandError, Refusal
from tether.shared.model_source import ModelSource, resolve_model_dir


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub")
    main = cache_hub_model(cache, "tether-test/tiny-qwen2")
    v2 = cache_hub_model(cache, "tether-test/tiny-qwen2", revision="v2")
    return cache, main, v2


def test_a_cached_hub_id_resolves_to_its_snapshot_at_main_or_a_revision(hub):
    cache, main, v2 = hub
    src = resolve_model_dir("--model", "tether-test/tiny-qwen2", TARGET_FILES, cache_dir=cache)
    assert (src.path, src.hub_id, src.commit) == (main, "tether-test/tiny-qwen2", main.name)
    assert resolve_model_dir("--model", "tether-test/tiny-qwen2", TARGET_FILES, "v2", cache_dir=cache).path == v2
    by_commit = resolve_model_dir("--model", "tether-test/tiny-qwen2", TARGET_FILES, v2.name, cache_dir=cache)
    assert by_commit.path == v2


def test_a_folder_is_used_as_it_is(hub, monkeypatch):
    cache, main, _ = hub
    assert resolve_model_dir("--model", str(main), TARGET_FILES, cache_dir=cache) == ModelSource(main)
    # A folder whose relative path is shaped like a hub id wins over the cache.
    monkeypatch.chdir(cache)
    local = f"{main.parents[1].name}/snapshots"
    src = resolve_model_dir("--model", local, (), cache_dir=cache)
    assert src.hub_id is None and src.path.resolve() == (cache / local).resolve()


@pytest.mark.parametrize(
    "name, revision",
    [("tether-test/not-there", ""), ("tether-test/tiny-qwen2", "v3"), ("tether-test/tiny-qwen2", "0" * 40)],
)
def test_an_uncached_hub_id_or_revision_is_one_line_saying_how_to_fetch_it(hub, name, revision):
    cache, _, _ = hub
    with pytest.raises(CommandError) as e:
        resolve_model_dir("--model", name, TARGET_FILES, revision, cache_dir=cache)
    assert e.value.reason == Refusal.NOT_CACHED and "\n" not in str(e.value)
    assert f"hf download {name}" in str(e.value) and str(cache) in str(e.value)


def test_a_cached_snapshot_missing_files_says_which(hub, tmp_path):
    cache, main, _ = hub
    broken = cache_hub_model(tmp_path, "tether-test/broken")
    (broken / "config.json").unlink()
    with pytest.raises(CommandError) as e:
        resolve_model_dir("--model", "tether-test/broken", TARGET_FILES, cache_dir=tmp_path)
    assert e.value.reason == Refusal.INCOMPLETE_DIR and "config.json" in str(e.value)
    assert "tether-test/broken" in str(e.value)


def test_hf_home_is_where_the_cache_is_looked_for(tmp_path):
    """With HF_HOME set (and no HF_HUB_CACHE), a hub id is found in HF_HOME/hub, as huggingface_hub puts it there,
    and the refusal of one that is not cached names that folder. In a child: huggingface_hub reads the variables
    when it is imported."""
    snapshot = cache_hub_model(tmp_path / "hub", "tether-test/tiny-qwen2")
    code = (
        "import json\n"
        "from tether.shared.cli_support import TARGET_FILES, CommandError\n"
        "from tether.shared.model_source import resolve_model_dir\n"
        "found = str(resolve_model_dir('--model', 'tether-test/tiny-qwen2', TARGET_FILES).path)\n"
        "try:\n"
        "    resolve_model_dir('--model', 'tether-test/not-there', TARGET_FILES)\n"
        "except CommandError as e:\n"
        "    print(json.dumps([found, str(e)]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env["HF_HOME"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stderr
    found, refused = json.loads(run.stdout)
    assert found == str(snapshot) and f"Hugging Face cache ({tmp_path / 'hub'})" in refused
