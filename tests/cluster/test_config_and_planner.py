"""Cluster config validation (field and line) and the planner's decisions."""

from __future__ import annotations

import pytest

from pdserve.cluster.config import PlannerConfig, load_config, parse_config
from pdserve.cluster.planner import Planner, RegionMetrics
from pdserve.core.errors import InvalidArgumentError
from pdserve.deploy.cluster_cli import example_config

GOOD = """\
model: builtin:tiny
regions:
  - name: east
    latency_ms: {west: 20}
    prefill: {count: 1, min: 1, max: 3}
    decode: {count: 1}
  - name: west
    prefill: {count: 1}
    decode: {count: 2, max: 4}
"""


def test_a_file_that_is_not_text_is_refused(tmp_path) -> None:
    binary = tmp_path / "cluster.yaml"
    binary.write_bytes(b"model: \xff\xfe")
    with pytest.raises(InvalidArgumentError, match=r"cluster\.yaml: not UTF-8 text"):
        load_config(binary)


def test_shipped_configs_load() -> None:
    local = load_config(example_config("local.yaml"))
    assert [r.name for r in local.regions] == ["east", "west"]
    assert local.router.auth_disabled and local.router.regions[0].latency_s == {"west": 0.02}
    multi = load_config(example_config("multinode.yaml"))
    assert multi.regions[0].prefill.parallel == {"tensor_parallel_size": 2}
    assert multi.regions[0].node_labels == {"pdserve/region": "us-east"}


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (
            ("    prefill: {count: 1, min: 1, max: 3}", "    prefill: {count: 5, min: 1, max: 3}"),
            "cfg.yaml:5: regions[0].prefill.count",
        ),
        (
            ("    decode: {count: 1}\n", "    decode: {count: 1, colour: blue}\n"),
            "cfg.yaml:6: regions[0].decode.colour",
        ),
        (("latency_ms: {west: 20}", "latency_ms: {north: 20}"), "regions[0].latency_ms.north"),
        (
            ("model: builtin:tiny", "model: builtin:tiny\nplanner: {mode: sometimes}"),
            "cfg.yaml:2: planner.mode",
        ),
        (
            ("model: builtin:tiny", "model: builtin:tiny\nplanner: {interval_s: 0}"),
            "cfg.yaml:2: planner.interval_s",
        ),
        (
            ("model: builtin:tiny", "model: builtin:tiny\nengine: {block_size: 0}"),
            "cfg.yaml:2: engine.block_size",
        ),
        (("model: builtin:tiny", "model: builtin:tiny\nwhatever: 1"), "cfg.yaml:2: whatever"),
        (  # a quoted "false" was bool("false"): auth turned off
            ("model: builtin:tiny", 'model: builtin:tiny\nauth: {disabled: "false"}'),
            "cfg.yaml:2: auth.disabled: must be a bool",
        ),
        (  # a misspelt key in a section was ignored (the SLO stayed at its default)
            ("model: builtin:tiny", "model: builtin:tiny\nslo: {ttft: 500}"),
            "cfg.yaml:2: slo.ttft: unknown field",
        ),
        (("model: builtin:tiny", "model: builtin:tiny\nauth: {disable: true}"), "auth.disable"),
        (("model: builtin:tiny", "model: builtin:tiny\nray: {cpus: 2}"), "cfg.yaml:2: ray.cpus"),
        (  # the engine's groups and model are not options (they raised a TypeError)
            ("model: builtin:tiny", "model: builtin:tiny\nengine: {cache: 1}"),
            "cfg.yaml:2: engine.cache: unknown engine option",
        ),
        (
            ("    decode: {count: 1}\n", "    decode: {count: 1, engine: {model: x}}\n"),
            "regions[0].decode.engine.model: unknown engine option",
        ),
        (
            ("    decode: {count: 1}\n", "    decode: {count: 1, engine: {max_num_seqs: -3}}\n"),
            "cfg.yaml:6: regions[0].decode.engine.max_num_seqs",
        ),
        (
            ("model: builtin:tiny", "model: builtin:tiny\nrouter: {without_prefill: wait}"),
            "cfg.yaml:2: router.without_prefill",
        ),
        (
            ("model: builtin:tiny", "model: builtin:tiny\nrouter: {max_migrations: two}"),
            "cfg.yaml:2: router.max_migrations",
        ),
        (("model: builtin:tiny", "model: builtin:tiny\nrouter: {colour: 1}"), "router.colour"),
        (  # min not given (it is count): not "must be within [min=5, max=2]"
            ("    decode: {count: 1}\n", "    decode: {count: 5, max: 2}\n"),
            "cfg.yaml:6: regions[0].decode.count: must be <= max (2), got 5",
        ),
        (
            ("    decode: {count: 1}\n", "    decode: {count: 1, min: 3}\n"),
            "regions[0].decode.count: must be >= min (3), got 1",
        ),
        (
            (
                "model: builtin:tiny",
                "model: builtin:tiny\nserver: {tls: {cert: /no.pem, key: /no.key}}",
            ),
            "cfg.yaml:2: server.tls.cert",
        ),
        (
            (
                "model: builtin:tiny",
                "model: builtin:tiny\nauth: {api_keys: [k1, {key: k2, prio: 1}]}",
            ),
            "auth.api_keys[1]",
        ),
        (
            (
                "model: builtin:tiny",
                "model: builtin:tiny\nauth: {api_keys: [{key: k, priority: x}]}",
            ),
            "auth.api_keys[0].priority",
        ),
        (  # a NaN passed every "> 0" check: reservations that never expire
            ("model: builtin:tiny", "model: builtin:tiny\nrouter: {reservation_ttl_s: .nan}"),
            "cfg.yaml:2: router.reservation_ttl_s: must be a finite number, got nan",
        ),
        (
            ("model: builtin:tiny", "model: builtin:tiny\nhealth: {stall_timeout_s: .inf}"),
            "cfg.yaml:2: health.stall_timeout_s: must be a finite number, got inf",
        ),
        (
            ("model: builtin:tiny", "model: builtin:tiny\nhealth: {drain_timeout_s: 0}"),
            "cfg.yaml:2: health.drain_timeout_s: must be > 0",
        ),
        (
            ("model: builtin:tiny", "model: builtin:tiny\nhealth: {place_timeout_s: -1}"),
            "cfg.yaml:2: health.place_timeout_s: must be > 0",
        ),
        (
            ("latency_ms: {west: 20}", "latency_ms: {west: -.inf}"),
            "regions[0].latency_ms.west: must be a finite number, got -inf",
        ),
        (
            ("model: builtin:tiny", "model: builtin:tiny\nconnector: nvlink"),
            "cfg.yaml:2: connector: unknown connector 'nvlink'; known: auto, cuda_ipc,",
        ),
    ],
)
def test_errors_name_the_field_and_the_line(edit, where) -> None:
    text = GOOD.replace(*edit)
    assert text != GOOD
    with pytest.raises(InvalidArgumentError) as err:
        parse_config(text, "cfg.yaml")
    assert where in str(err.value), str(err.value)


def test_role_engine_options_override_the_cluster_ones() -> None:
    text = GOOD.replace(
        "    prefill: {count: 1, min: 1, max: 3}",
        "    prefill: {count: 1, min: 1, max: 3, engine: {max_num_batched_tokens: 1024}}",
    )
    config = parse_config(text)
    region = config.regions[0]
    assert config.engine_config("prefill", region).scheduler.max_num_batched_tokens == 1024
    default = parse_config(GOOD).engine_config("decode", region)
    decode = config.engine_config("decode", region)
    assert decode.scheduler.max_num_batched_tokens == default.scheduler.max_num_batched_tokens


def planner(**overrides) -> Planner:
    config = parse_config(GOOD)
    settings = PlannerConfig(mode="on", cooldown_s=10, idle_s=20, **overrides)
    return Planner(
        settings, ttft_slo_s=1.0, tpot_slo_s=0.1, regions={r.name: r for r in config.regions}
    )


def metrics(**values) -> RegionMetrics:
    base = dict(
        region="east",
        prefill_count=1,
        decode_count=1,
        requests=50,
        ttft_p90_s=0.5,
        tpot_p90_s=0.05,
        prefill_queue_s=0.1,
        decode_kv_usage=0.2,
        decode_batch=4.0,
    )
    return RegionMetrics(**{**base, **values})


def test_prefill_overload_adds_prefill_then_cools_down() -> None:
    p = planner()
    hot = metrics(ttft_p90_s=3.0)
    decision = p.decide(hot, now=100.0)
    assert (
        decision is not None
        and decision.action == "add_prefill"
        and "TTFT p90 3000 ms" in decision.reason
    )
    assert p.decide(hot, now=105.0) is None  # cooling down
    assert p.decide(metrics(prefill_count=2, ttft_p90_s=3.0), now=111.0).action == "add_prefill"
    assert p.decide(metrics(prefill_count=3, ttft_p90_s=3.0), now=125.0) is None  # at max


def test_decode_pressure_adds_decode() -> None:
    p = planner()
    assert p.decide(metrics(tpot_p90_s=0.5), now=100.0).action == "add_decode"
    assert (
        p.decide(metrics(region="west", decode_count=2, decode_kv_usage=0.95), now=100.0).action
        == "add_decode"
    )


def test_between_the_bands_nothing_changes() -> None:
    p = planner()
    for t in range(100, 200, 5):
        assert p.decide(metrics(ttft_p90_s=0.6), now=float(t)) is None


def test_a_long_calm_removes_one_instance_within_bounds() -> None:
    p = planner()
    calm = metrics(
        prefill_count=3, requests=0, ttft_p90_s=None, tpot_p90_s=None, prefill_queue_s=0.0
    )
    assert p.decide(calm, now=100.0) is None  # calm starts
    assert p.decide(calm, now=110.0) is None  # not long enough
    decision = p.decide(calm, now=121.0)
    assert decision.action == "remove_prefill" and "no traffic" in decision.reason
    at_min = metrics(requests=0, ttft_p90_s=None, tpot_p90_s=None, prefill_queue_s=0.0)
    p2 = planner()
    assert p2.decide(at_min, now=0.0) is None and p2.decide(at_min, now=50.0) is None


def test_advisory_decisions_are_recorded_not_applied() -> None:
    config = parse_config(GOOD)
    p = Planner(PlannerConfig(mode="advisory"), 1.0, 0.1, {r.name: r for r in config.regions})
    decision = p.decide(metrics(ttft_p90_s=5.0), now=1000.0)
    assert decision is not None and not decision.applied and p.history == [decision]


def test_router_options_and_tls_reach_the_router(tmp_path) -> None:
    (tmp_path / "c.pem").write_text("cert")
    (tmp_path / "k.pem").write_text("key")
    extra = (
        "router: {without_prefill: spill, stream_idle_timeout_s: 30, hedge_after_ms: 250}\n"
        f"server: {{tls: {{cert: {tmp_path / 'c.pem'}, key: {tmp_path / 'k.pem'}}}}}"
    )
    config = parse_config(GOOD.replace("model: builtin:tiny", f"model: builtin:tiny\n{extra}"))
    router = config.router
    assert (router.without_prefill, router.stream_idle_timeout_s) == ("spill", 30.0)
    assert router.hedge_after_s == 0.25
    assert router.tls is not None and router.tls.cert == str(tmp_path / "c.pem")


def test_an_api_key_may_carry_a_default_priority() -> None:
    from pdserve.router.frontdoor.auth import ApiKeys

    text = GOOD + "auth: {api_keys: [online, {key: batch, priority: -2}]}\n"
    router = parse_config(text).router
    assert router.api_keys == ("online", "batch")
    assert router.api_key_priorities == (("batch", -2),)
    keys = ApiKeys(router.api_keys, False, router.api_key_priorities)
    assert keys.check("Bearer batch") == -2 and keys.check("Bearer online") is None


def test_a_quoted_number_is_its_number_as_before() -> None:
    # templates quote what they fill in; int("2") and float("500") were read before
    text = GOOD.replace("prefill: {count: 1, min: 1, max: 3}", 'prefill: {count: "2", max: 3}')
    config = parse_config(text + 'slo: {ttft_ms: "500"}\nserver: {grpc_port: "50051"}\n')
    assert config.regions[0].prefill.count == 2 and config.router.ttft_slo_s == 0.5
    assert config.router.grpc_port == 50051
    with pytest.raises(InvalidArgumentError, match=r"slo\.ttft_ms: must be a finite number"):
        parse_config(GOOD + 'slo: {ttft_ms: "inf"}\n')


def test_planner_mode_on_and_off_need_no_quotes() -> None:
    # YAML reads unquoted on/off as booleans: "must be a str" was all a user got
    assert parse_config(GOOD + "planner: {mode: on}\n").planner.mode == "on"
    assert parse_config(GOOD + "planner: {mode: off}\n").planner.mode == "off"
    with pytest.raises(InvalidArgumentError, match="unquoted word as False: quote it"):
        parse_config(GOOD + "router: {policy: off}\n")


def test_an_api_key_may_be_an_admins() -> None:
    text = GOOD + "auth: {api_keys: [client, {key: ops, admin: true}, {key: b, admin: false}]}\n"
    router = parse_config(text).router
    assert router.api_keys == ("client", "ops", "b") and router.api_key_admins == ("ops",)
    with pytest.raises(InvalidArgumentError, match=r"auth.api_keys\[0\].admin: must be a bool"):
        parse_config(GOOD + "auth: {api_keys: [{key: k, admin: yes please}]}\n")


def _leaves(value, path=""):
    """(dotted field path as the config's errors name it, value) of every value."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, child in items:
        sub = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        if isinstance(child, dict | list) and child:
            yield from _leaves(child, sub)
        yield sub, child


def test_a_value_of_the_wrong_type_anywhere_is_refused_naming_its_field() -> None:
    # Every field of the shipped config, set to a word, a list and 1.5 in turn: each
    # either loads or is refused naming that field (a count read as int("two") raised a
    # ValueError, a planner interval of "abc" a TypeError from its own "< 0" check)
    import yaml

    text = example_config("local.yaml").read_text()
    good = yaml.safe_load(text)
    refused, wrong = 0, []
    for path, value in list(_leaves(good)):
        for bad in ("abc", [1], 1.5):
            if isinstance(value, str) and bad == "abc":
                continue  # another word is another name (a region's: others name it)
            config = yaml.safe_load(text)
            parent, key = _parent(config, path)
            parent[key] = bad
            try:
                parse_config(yaml.safe_dump(config), "local.yaml")
            except InvalidArgumentError as e:
                refused += 1
                if not (e.field.startswith(path) or path.startswith(e.field)):
                    wrong.append((path, bad, str(e)))
    assert not wrong
    assert refused > 60  # most fields are numbers or sections


def _parent(config, path: str):
    keys = [
        int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")
    ]
    for key in keys[:-1]:
        config = config[key]
    return config, keys[-1]
