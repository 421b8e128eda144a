import pytest

from hicache.config import (
    HiCacheConfig,
    L1Config,
    L2Config,
    L3Config,
    PolicyConfig,
    backend_environment,
    parse_size,
)
from tiers.layout import KVLayout

LAYOUT = KVLayout(
    kind="mha", num_layers=2, page_size=16, dtype="bfloat16", num_kv_heads=2, head_dim=8
)


def test_from_env_reads_every_component():
    config = HiCacheConfig.from_env(
        environ={
            "HICACHE_LAYOUT": LAYOUT.descriptor(),
            "HICACHE_DEVICE": "cuda:1",
            "HICACHE_L1_PAGES": "1024",
            "HICACHE_L2_SIZE": "8GiB",
            "HICACHE_L2_PIN": "false",
            "HICACHE_L3_URL": "file:///data/kv?capacity=1TiB",
            "HICACHE_L3_WRITE_POLICY": "on_evict",
            "HICACHE_WRITE_POLICY": "write_back",
            "HICACHE_PREFETCH_POLICY": "best_effort",
            "HICACHE_PREFETCH_MIN_PAGES": "4",
            "HICACHE_EVICTION_POLICY": "lfu",
        }
    )
    assert config.layout == LAYOUT
    assert config.l1 == L1Config(device="cuda:1", num_pages=1024)
    assert config.l2.budget_bytes == 8 * 2**30 and config.l2.pin_memory is False
    assert config.l3.url.startswith("file:///data/kv") and config.l3.write_policy == "on_evict"
    assert config.policy.write_policy == "write_back"
    assert config.policy.prefetch_policy == "best_effort"
    assert config.policy.prefetch_min_pages == 4 and config.policy.eviction_policy == "lfu"


def test_from_env_names_the_bad_variable():
    with pytest.raises(ValueError, match="HICACHE_L2_SIZE='lots'"):
        HiCacheConfig.from_env(LAYOUT, environ={"HICACHE_L2_SIZE": "lots"})
    with pytest.raises(ValueError, match="unknown HICACHE_ variables.*HICACHE_L2_SZE"):
        HiCacheConfig.from_env(LAYOUT, environ={"HICACHE_L2_SZE": "1GiB"})
    with pytest.raises(ValueError, match="HICACHE_LAYOUT is required"):
        HiCacheConfig.from_env(environ={})
    with pytest.raises(ValueError, match="write_policy must be one of"):
        HiCacheConfig.from_env(LAYOUT, environ={"HICACHE_WRITE_POLICY": "sometimes"})


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: L1Config(num_pages=-1), "L1Config.num_pages"),
        (lambda: L1Config(device="tpu"), "L1Config.device"),
        (lambda: L1Config(memory_fraction=1.5), "L1Config.memory_fraction"),
        (lambda: L2Config(budget_bytes=-5), "L2Config.budget_bytes"),
        (lambda: L3Config(url="nowhere"), "L3Config.url"),
        (lambda: L3Config(write_policy="never"), "L3Config.write_policy"),
        (lambda: L3Config(prefetch_chunk_pages=0), "L3Config.prefetch_chunk_pages"),
        (lambda: PolicyConfig(prefetch_policy="maybe"), "PolicyConfig.prefetch_policy"),
        (lambda: PolicyConfig(eviction_policy="fifo"), "PolicyConfig.eviction_policy"),
        (lambda: PolicyConfig(write_through_threshold=0), "write_through_threshold"),
        (lambda: PolicyConfig(prefetch_min_pages=0), "prefetch_min_pages"),
        (lambda: HiCacheConfig(layout="mha"), "HiCacheConfig.layout"),
    ],
)
def test_bad_values_name_the_field(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "-0.5"])
@pytest.mark.parametrize(
    "variable", ["HICACHE_PREFETCH_TIMEOUT_PER_1K_S", "HICACHE_PREFETCH_TIMEOUT_BASE_S"]
)
def test_prefetch_timeouts_must_be_finite_and_non_negative(variable, value):
    """`inf` once passed and made match() raise OverflowError; the field is named."""
    with pytest.raises(ValueError, match=r"PolicyConfig\.prefetch_timeout_.* in \[0, 3600\]"):
        HiCacheConfig.from_env(LAYOUT, environ={variable: value})


def test_the_tenant_secret_is_a_file_named_by_a_variable():
    config = HiCacheConfig.from_env(
        LAYOUT,
        environ={
            "HICACHE_L2_SIZE": "1GiB",
            "HICACHE_L3_URL": "file:///data/kv?capacity=1TiB",
            "HICACHE_L3_SECRET_FILE": "/etc/hicache/team-a.secret",
        },
    )
    assert config.l3.secret_file == "/etc/hicache/team-a.secret"
    with pytest.raises(ValueError, match="secret_file needs an L3 url"):
        L3Config(secret_file="/etc/hicache/team-a.secret")


def test_l3_exists_timeout_must_be_finite():
    with pytest.raises(ValueError, match=r"exists_timeout_s must be in \(0, 3600\]"):
        L3Config(exists_timeout_s=float("inf"))


def test_how_long_an_l3_lookup_stands_is_checked():
    for seconds in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"ask_again_s must be in \[0, 3600\]"):
            L3Config(ask_again_s=seconds)
    config = HiCacheConfig.from_env(LAYOUT, {"HICACHE_L3_ASK_AGAIN_S": "0"})
    assert config.l3.ask_again_s == 0.0 and L3Config().ask_again_s == 0.5


def test_sizes_and_budgets():
    # The grammar itself is tested with storage_backends' (test_registry); here: it is the
    # same function, and the environment goes through it.
    from storage_backends.options import parse_size as the_one

    assert parse_size is the_one
    with pytest.raises(ValueError, match="HICACHE_L2_SIZE='8G'.*not a size"):
        HiCacheConfig.from_env(LAYOUT, {"HICACHE_L2_SIZE": "8G"})
    policy = PolicyConfig(prefetch_timeout_base_s=0.05, prefetch_timeout_per_1k_tokens_s=0.01)
    assert policy.prefetch_budget_s(4000) == pytest.approx(0.09)


@pytest.mark.parametrize("value", [1e308, 1e18, float("inf"), float("nan"), -1.0, 3601.0])
@pytest.mark.parametrize("name", ["prefetch_timeout_base_s", "prefetch_timeout_per_1k_tokens_s"])
def test_a_prefetch_timeout_out_of_its_stated_range_is_refused_by_name(name, value):
    """(1e308 and 1e18 used to pass, then make match() raise OverflowError.)"""
    with pytest.raises(ValueError, match=rf"PolicyConfig.{name} must be in \[0, 3600\]"):
        PolicyConfig(**{name: value})


@pytest.mark.parametrize("value", [1e18, float("nan"), 0.0, 3601.0])
def test_the_exists_timeout_is_checked_against_its_range(value):
    with pytest.raises(ValueError, match=r"L3Config.exists_timeout_s must be in \(0, 3600\]"):
        L3Config(exists_timeout_s=value)


def test_a_backend_inside_an_engine_takes_only_the_l3_url_and_secret():
    assert backend_environment({}) == {}
    env = {"HICACHE_L3_URL": "file:///kv", "HICACHE_L3_SECRET_FILE": "/s", "HICACHE_DEMO_X": "1"}
    assert backend_environment(env) == {"url": "file:///kv", "secret_file": "/s"}
    with pytest.raises(ValueError, match="HICACHE_L2_SIZE, HICACHE_LAYOUT: a storage backend"):
        backend_environment({"HICACHE_LAYOUT": "x", "HICACHE_L2_SIZE": "1GiB"})
    with pytest.raises(ValueError, match="HICACHE_L3_SECRET_FILE is set but empty"):
        backend_environment({"HICACHE_L3_URL": "file:///kv", "HICACHE_L3_SECRET_FILE": ""})
