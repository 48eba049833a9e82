"""Method descriptors: one typed, frozen settings class per method, parsed once, used by both
halves; the one registry; the docs that show them; the worked example of "Adding a method"."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
from example_method import HEADS_ARTIFACT, HeadAvgSettings, register
from fleet_helpers import tiny_fleet

from fedge.broker.limits import ENVELOPE_BYTES, largest_message_bytes, largest_model_bytes
from fedge.common.method_settings import FedVTCSettings, GeFLFSettings, GeFLSettings
from fedge.common.settings import MethodSettings, settings_table, sync_tables, table_marker
from fedge.edge.methods.base import model_arrays
from fedge.errors import ConfigError
from fedge.fleet.config import parse_fleet
from fedge.fleet.registry import BUILTIN_SETTINGS, METHODS, method_entry

ROOT = Path(__file__).resolve().parents[1]
KEYED = [s for s in BUILTIN_SETTINGS if s.fields_by_key()]


def test_the_registry_names_each_method_once_with_matching_halves() -> None:
    assert [e.settings for e in METHODS.values() if e.settings in BUILTIN_SETTINGS] == list(BUILTIN_SETTINGS)
    for name, entry in METHODS.items():
        device, coordinator = entry.device_half(), entry.coordinator_half()
        assert name == entry.settings.method == device.name == coordinator.name
        # written once, in the settings class: no half (nor a base of one) sets its own name
        assert [c for half in (device, coordinator) for c in half.__mro__ if isinstance(vars(c).get("name"), str)] == []
        assert device.settings_type is entry.settings and coordinator.settings_type is entry.settings


@pytest.mark.parametrize("cls", KEYED, ids=lambda c: c.method)
def test_an_unknown_key_names_it_suggests_the_closest_and_lists_the_valid_ones(cls: type[MethodSettings]) -> None:
    key = next(iter(cls.fields_by_key()))
    typo = key[:-1] + ("x" if key[-1] != "x" else "y")  # one letter off
    where = rf"fleet\.toml: \[method\] unknown key '{typo}'"
    with pytest.raises(ConfigError, match=rf"{where} for method '{cls.method}'") as e:
        method_entry(cls.method).parse({typo: 1}, source="fleet.toml")
    assert e.value.hint == f"did you mean {key!r}? valid keys: {', '.join(cls.fields_by_key())}"
    with pytest.raises(ConfigError, match="unknown key 'zzzz'") as e:
        cls.parse({"zzzz": 1})
    assert e.value.hint == f"valid keys: {', '.join(cls.fields_by_key())}"  # nothing close: no guess


def test_methods_without_keys_refuse_any() -> None:
    for name in ("local", "fedavg", "lgfedavg"):
        with pytest.raises(ConfigError, match=f"method '{name}' takes no \\[method\\] keys"):
            method_entry(name).parse({"avg_extractor": False})
        assert method_entry(name).parse({}) == method_entry(name).parse(None)


@pytest.mark.parametrize(("cls", "table", "message"), [
    (GeFLSettings, {"gen_epochs": "5"}, "gen_epochs must be an integer >= 1, got '5'"),
    (GeFLSettings, {"gen_epochs": 2.0}, "gen_epochs must be an integer >= 1, got 2.0"),
    (GeFLSettings, {"gen_rounds": True}, "gen_rounds must be an integer >= 0, got True"),
    (GeFLSettings, {"avg_extractor": "false"}, "avg_extractor must be true or false, got 'false'"),
    (GeFLSettings, {"generator_tier": 1}, "generator_tier must be a string, got 1"),
    (GeFLSettings, {"generator_tier": "huge"}, "generator_tier must be one of 'tiny', 'small', 'paper', got 'huge'"),
    (GeFLSettings, {"gen_lr": -1}, r"gen_lr must be a number > 0, got -1"),
    (GeFLSettings, {"gen_batch_size": 1}, "gen_batch_size must be an integer >= 2, got 1"),
    (GeFLFSettings, {"ddpm_guidance": "2"}, "ddpm_guidance must be a number >= 0, got '2'"),
    (FedVTCSettings, {"kl_weight": -0.1}, "kl_weight must be a number >= 0, got -0.1"),
    (FedVTCSettings, {"finetune": 1}, "finetune must be a string, got 1"),
    (FedVTCSettings, {"decoder_lr": float("nan")}, "decoder_lr must be a number > 0, got nan"),
    (FedVTCSettings, {"recon_noise": float("inf")}, "recon_noise must be a number >= 0, got inf"),
])
def test_wrong_types_and_out_of_range_values_are_named(cls: type[MethodSettings], table: dict[str, object],
                                                       message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"x.toml: [method] {message}")):
        cls.parse(table, source="x.toml")


def test_a_method_table_that_is_not_a_table_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"x\.toml: \[method\] must be a table, got list"):
        GeFLSettings.parse([("gen_rounds", 1)], source="x.toml")  # type: ignore[arg-type]


def test_settings_are_frozen_typed_and_resolve_their_defaults() -> None:
    s = GeFLSettings.parse({"gen_lr": 1, "generator": "dcgan"})
    assert s.gen_lr == 1.0 and isinstance(s.gen_lr, float)  # an integer where a number is expected
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.gen_epochs = 3  # type: ignore[misc]
    # defaults decided elsewhere stay None in the settings and resolve where the context is known
    assert s.generator_trains_in_target and not GeFLSettings().generator_trains_in_target
    assert not GeFLSettings(generator="dcgan", train_generator_in_target=False).generator_trains_in_target
    assert GeFLSettings().real_epochs_or(5) == 5 and GeFLSettings(real_epochs=2).real_epochs_or(5) == 2
    assert FedVTCSettings().decoder_epochs_or(3) == 3
    assert GeFLSettings.parse(s.to_table()) == s  # a round trip through the table form


def test_a_half_refuses_another_methods_settings() -> None:
    with pytest.raises(ConfigError, match=r"GeFLStrategy needs GeFLSettings .* got FedVTCSettings"):
        method_entry("gefl").build_strategy(FedVTCSettings(), num_classes=10, rounds=200)
    # one parse serves both halves: the strategy keeps the very instance it was given
    s = method_entry("gefl").parse({"gen_rounds": 2})
    assert method_entry("gefl").build_strategy(s, num_classes=10, rounds=3).settings is s


def test_an_unknown_method_suggests_the_closest() -> None:
    with pytest.raises(ConfigError, match="unknown method 'fedvct'") as e:
        method_entry("fedvct")
    assert (e.value.hint or "").startswith("did you mean 'fedvtc'?")



def test_the_broker_sizes_each_method_from_its_settings() -> None:
    # the methods whose messages may carry a generator besides the model, read off their settings
    assert {s.method for s in BUILTIN_SETTINGS if s.generative} == {"gefl", "geflf", "fedvtc"}
    model = largest_model_bytes(["tier-xs"])
    assert largest_message_bytes(["tier-xs"], "geflf") == 2 * model + ENVELOPE_BYTES
    assert largest_message_bytes(["tier-xs"], "fedproto") == model + ENVELOPE_BYTES
    register()  # a method added by its registry line alone is sized too
    assert largest_message_bytes(["tier-xs"], "headavg") == model + ENVELOPE_BYTES
    with pytest.raises(ConfigError, match="unknown method 'gefl-f'"):
        largest_message_bytes(["tier-xs"], "gefl-f")

# -- docs ------------------------------------------------------------------------------------------

def test_methods_md_shows_every_descriptors_key_table_as_generated() -> None:
    doc = (ROOT / "docs" / "methods.md").read_text()
    for cls in KEYED:
        assert table_marker(cls)[0] in doc, f"docs/methods.md has no generated key table for {cls.method}"
    fixed = sync_tables(doc, BUILTIN_SETTINGS)
    assert fixed == doc, (
        "docs/methods.md is out of date with fedge/common/method_settings.py; regenerate with\n"
        "python -c 'from pathlib import Path; from fedge.fleet.registry import BUILTIN_SETTINGS; "
        "from fedge.common.settings import sync_tables; p = Path(\"docs/methods.md\"); "
        "p.write_text(sync_tables(p.read_text(), BUILTIN_SETTINGS))'")
    for cls in KEYED:  # every field documented, with a default
        table = settings_table(cls)
        assert all(f"| `{k}` |" in table for k in cls.fields_by_key())


def _section(path: Path, title: str) -> str:
    text = path.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_adding_a_method_walkthrough_is_the_tested_example() -> None:
    section = _section(ROOT / "docs" / "architecture.md", "Adding a method")
    blocks = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", section, re.S)]
    assert len(blocks) == 4
    example = (ROOT / "tests" / "example_method.py").read_text()
    for block in blocks[:3]:  # the descriptor and both halves, verbatim
        assert block in example, block[:200]
    assert 'MethodEntry(HeadAvgSettings, _E + "headavg:HeadAvgDevice", _C + "headavg:HeadAvgStrategy"),' in blocks[3]


def test_the_example_method_runs_on_a_fleet_and_shares_only_heads() -> None:
    register()
    # its registry line is all the fleet config and both halves need: the name comes from the settings
    entry = method_entry("headavg")
    assert entry.device_half().name == entry.coordinator_half().name == "headavg"
    cfg = parse_fleet({"run": {"method": "headavg", "rounds": 2, "dataset": "digits"}, "method": {"every": 2},
                       "devices": [{"profile": "rpi3b", "count": 2}]})
    assert cfg.method_config == HeadAvgSettings(every=2)
    fleet = tiny_fleet("headavg", ["cnn3-p32", "cnn1-p32", "cnn3-p32"], rounds=2, method_config={"every": 2})
    fleet.engine.run_round(1)  # not a sharing round: nothing uploaded, nothing published
    assert fleet.engine.globals == {}
    fleet.engine.run_round(2)
    heads = fleet.engine.globals[HEADS_ARTIFACT]
    assert set(heads) == {"head.weight", "head.bias"}
    fleet.engine.run_round(3)  # final: every device applies the shared head, across architectures
    models = [a.method.ctx.model for a in fleet.agents]
    for m in models:
        for k, v in model_arrays(m, ["head."]).items():
            np.testing.assert_array_equal(v, heads[k])
    ext = [model_arrays(m, ["extractor."])["extractor.0.weight"] for m in models]
    assert not np.array_equal(ext[0], ext[2])  # same architecture, but extractors stay each device's own
    with pytest.raises(ConfigError, match="did you mean 'every'"):
        HeadAvgSettings.parse({"evry": 2})


def test_asynchronous_mode_is_opt_in_per_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method that declares no async_rule is refused in asynchronous mode, naming why; the worked example
    declares one (and weighs its heads by the staleness weight); every built-in method but local does."""
    register()
    doc = {"run": {"method": "headavg", "rounds": 2, "dataset": "digits"}, "coordinator": {"mode": "async"},
           "devices": [{"profile": "rpi3b", "count": 3}]}
    assert HeadAvgSettings.async_rule and parse_fleet(doc).asynchronous is not None
    monkeypatch.setattr(HeadAvgSettings, "async_rule", "")
    with pytest.raises(ConfigError) as err:
        parse_fleet(doc, source="fleet.toml")
    assert err.value.message.startswith('fleet.toml: [coordinator] mode = "async" cannot run headavg: headavg '
                                        "declares no asynchronous rule (its settings' async_rule)")
    assert "a stale update would count as a fresh one" in err.value.message
    assert parse_fleet({**doc, "coordinator": {}}).asynchronous is None  # synchronous rounds need no rule
    blockers = {s.method: s.async_blocker() for s in BUILTIN_SETTINGS}
    assert [name for name, b in blockers.items() if b is not None] == ["local"]
