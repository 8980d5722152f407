"""The KV pool's size (tether.server.pool_budget): auto from the free memory a CUDA device reports (faked numbers, no
GPU), an explicit --kv-pool-mb, the CPU's fixed default, the split over --engines and --tp ranks, and the refusals a
user can act on."""

import pytest

from tether.server.pool_budget import CPU_DEFAULT_MB, DEFAULT_SHARE, MB, MIN_AUTO_MB, resolve_kv_pool

GB = 1024 * MB
H200 = (122_880 * MB, 143_771 * MB)  # (free, total) once the default models are loaded


def test_auto_on_cuda_takes_the_share_of_the_free_memory_and_says_so():
    budget = resolve_kv_pool(0, 0.5, "cuda:0", mem_info=H200)
    assert budget.bytes == 61_440 * MB and budget.auto
    assert budget.note == "KV pool 61,440 MB: 50% of 122,880 MB free on cuda:0 (auto; --kv-pool-mb sets it)"
    assert resolve_kv_pool(0, 0.8, "cuda:0", mem_info=H200).bytes == 98_304 * MB


def test_auto_is_whole_megabytes_and_never_reaches_the_free_memory():
    free = 10 * GB + 12_345
    budget = resolve_kv_pool(0, 0.99, "cuda", mem_info=(free, 80 * GB))
    assert budget.bytes % MB == 0 and budget.bytes < free


def test_an_explicit_size_is_taken_as_given():
    budget = resolve_kv_pool(4096, DEFAULT_SHARE, "cuda:0", mem_info=H200)
    assert (budget.bytes, budget.auto) == (4096 * MB, False)
    assert budget.note == "KV pool 4,096 MB (--kv-pool-mb)"
    assert resolve_kv_pool(8, device="cpu").bytes == 8 * MB  # no memory to check it against


def test_auto_off_cuda_is_the_fixed_default():
    budget = resolve_kv_pool(0, DEFAULT_SHARE, "cpu")
    assert budget.bytes == CPU_DEFAULT_MB * MB == 256 * MB and budget.auto
    assert budget.note == "KV pool 256 MB: the 256 MB default on cpu (auto; --kv-pool-mb sets it)"


def test_engines_split_the_auto_budget_but_not_an_explicit_share_again():
    three = resolve_kv_pool(0, 0.5, "cuda:0", engines=3, mem_info=H200)
    assert three.bytes == 20_480 * MB and "over 3 engines" in three.note
    assert resolve_kv_pool(0, 0.5, "cpu", engines=3).bytes == 85 * MB  # 256 // 3, as engine_share splits 256
    # An explicit --kv-pool-mb reaches each engine already divided (tether.server.engines.engine_share).
    given = resolve_kv_pool(1365, 0.5, "cuda:0", engines=3, mem_info=H200)
    assert given.bytes == 1365 * MB and "this engine's share of --kv-pool-mb over 3 engines" in given.note


def test_tensor_parallel_ranks_take_the_least_free_memory_per_rank():
    ranks = [(60 * GB, 80 * GB), (50 * GB, 80 * GB)]
    budget = resolve_kv_pool(0, 0.5, "cuda:0", tp=2, mem_info=ranks)
    assert budget.bytes == 25 * GB and "per rank" in budget.note and "the least of 2 ranks" in budget.note
    assert resolve_kv_pool(0, 0.5, "cuda:0", tp=2, mem_info=ranks[0]).bytes == 30 * GB  # rank 0's for all
    assert resolve_kv_pool(2048, 0.5, "cuda:0", tp=2, mem_info=ranks).bytes == 2048 * MB  # each rank's, as before
    with pytest.raises(ValueError, match="one per rank"):
        resolve_kv_pool(0, 0.5, "cuda:0", tp=4, mem_info=ranks)


def test_too_little_free_memory_is_refused_with_what_to_do():
    full = (100 * MB, 80 * GB)
    with pytest.raises(ValueError) as e:
        resolve_kv_pool(0, 0.5, "cuda:0", mem_info=full)
    msg = str(e.value)
    assert "cuda:0 has 100 MB free of 81,920 MB" in msg and f"below the {MIN_AUTO_MB} MB" in msg
    assert "--kv-pool-mb" in msg and "nvidia-smi" in msg
    with pytest.raises(ValueError, match="run fewer --engines"):  # enough for one engine, not for eight
        resolve_kv_pool(0, 0.5, "cuda:0", engines=8, mem_info=(800 * MB, 80 * GB))


def test_an_explicit_size_over_the_free_memory_is_refused():
    with pytest.raises(ValueError, match=r"--kv-pool-mb 200000 asks for more than the 122,880 MB free on cuda:0"):
        resolve_kv_pool(200_000, 0.5, "cuda:0", mem_info=H200)


OUT_OF_RANGE = [(-1, 0.5, "--kv-pool-mb is 0"), (0, 0.0, "--kv-pool-share"), (0, 1.0, "--kv-pool-share"),
                (0, -0.5, "--kv-pool-share")]  # fmt: skip


@pytest.mark.parametrize(("mb", "share", "match"), OUT_OF_RANGE)
def test_flags_out_of_range_are_refused(mb, share, match):
    with pytest.raises(ValueError, match=match):
        resolve_kv_pool(mb, share, "cpu")


def test_auto_on_cuda_without_the_free_memory_is_a_callers_mistake():
    with pytest.raises(ValueError, match="mem_get_info"):
        resolve_kv_pool(0, 0.5, "cuda:0")
