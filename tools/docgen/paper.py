"""The paper's published figures the reproduction report sets beside ours — the only figures in
the report typed in by hand (paper: *Towards Load-Aware Prefill Deflection for
Disaggregated LLM Serving*, Table 3, Table 4 and §6).
"""

from __future__ import annotations

# Table 3's P95 breakdown (ms) and Table 4 (Bursty).
PAPER_T3 = {  # workload: (prefill queue, prefill exec, kv transfer, decode queue, TTFT)
    "lpld": (59, 191, 4205, 55, 6279), "lphd": (54, 177, 1429, 59, 7876), "hpld": (655, 1340, 1723, 37, 5782),
    "hphd": (350, 1223, 3585, 55, 6292), "bursty": (841, 1070, 2176, 56, 7894),
}

PAPER_RPS = {"lpld": 22, "lphd": 20, "hpld": 1, "hphd": 1, "bursty": 4}

PAPER_T4 = {  # policy: (deflections, P95 TTFT s, TBT viol %, SLO %)
    "pd": (0, 4.5, 0.0, 88.0), "sq:1": (7, 4.2, 1.0, 91.7), "sq:4": (0, 4.5, 0.0, 88.0), "sl:512": (3, 4.5, 0.0, 88.0),
    "sl:1024": (151, 4.1, 0.0, 94.1), "sl:2048": (298, 3.6, 1.5, 95.1), "oracle": (251, 2.6, 0.0, 99.5),
}

PAPER_LP_MEDIAN = 842  # paper §3: median prompt of its LP stratum (tokens)

PAPER_S6 = {"pd": 7, "kairos": 9, "taichi": 7, "gain_pct": 28.5, "tbt_above_pd_ms": "5–10",
            "defl_low": (6, 500), "defl_high": (12, 265)}  # paper §6: sustainable RPS, Fig. 4–6
