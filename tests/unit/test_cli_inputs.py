"""CLI inputs a new user got wrong (fresh-user trial): each is a usage message, not a late failure."""

from click.testing import CliRunner

from kairos.cli import main as cli
from kairos.cli.commands.stack import engine_defaults_or_exit


def test_an_empty_served_model_is_a_usage_error_before_anything_starts():
    r = CliRunner().invoke(cli.main, ["up", "--served-model", " "])
    assert r.exit_code == 2 and "--served-model" in r.output and "must not be empty" in r.output, r.output


def test_decide_on_empty_input_says_so():
    r = CliRunner().invoke(cli.main, ["decide"], input="")
    assert r.exit_code == 2 and "the input is empty" in r.output, r.output


def test_a_cluster_without_a_fault_tolerant_majority_is_warned_about(tmp_path):
    r = CliRunner().invoke(cli.main, ["nats-cluster", "--hosts", "10.0.0.1,10.0.0.2", "--conf-dir", str(tmp_path)])
    assert r.exit_code == 0 and "survive the loss of 0" in r.output, r.output
    r = CliRunner().invoke(cli.main, ["nats-cluster", "--hosts", "10.0.0.1,10.0.0.2,10.0.0.3", "--conf-dir", str(tmp_path)])
    assert r.exit_code == 0 and "warning" not in r.output, r.output


def test_vllm_engines_without_a_model_get_the_testbed_model(monkeypatch):
    """``kairos up --engine vllm`` without ``--model`` exited 2; it now takes the CPU testbed's
    generated model, as ``kairos demo --engine vllm`` does."""
    import kairos.engines.vllm.launch

    asked = []
    monkeypatch.setattr(kairos.engines.vllm.launch, "cached_tiny_model", lambda size="tiny", python=None: asked.append(size) or "/m")
    opts = {"engine": "vllm", "model_dir": None, "profile": None, "served_model": None}
    engine_defaults_or_exit(opts)
    from kairos.cli.demo import VLLM_DEMO
    assert opts["model_dir"] == "/m" and asked == [VLLM_DEMO["model_size"]]
    assert opts["profile"] == "cpu-testbed-vllm" and opts["served_model"] == "kairos-vllm"
