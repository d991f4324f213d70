"""Fault injection for the ``faults`` test tier: ``KAIROS_FAULT_AT=<step>`` makes a dispatcher
process die (``os._exit(FAULT_EXIT_CODE)``, no cleanup, like SIGKILL) the first time a request
reaches that step of the routing protocol; with ``KAIROS_FAULT_MODE=stop`` it SIGSTOPs itself there
instead (once), so a test can SIGCONT it after its ack wait has passed. Only honoured when the
variable is set; unset (every normal run) each hook is one string comparison.

Steps, in protocol order (kairos/services/dispatcher/intake.py and route.py):

* ``before_decide`` — taken (answered ``taken`` to the ingress), nothing decided yet;
* ``after_decide`` — the decision is made (a deflection's decode-node slot is held in this replica's
  memory only: the node publishes the reservation when it accepts the job);
* ``after_publish`` — the job was handed to the request's ingress (flushed), which sends it to the
  node; its answer not yet received;
* ``after_accept`` — the node accepted the job; no routing event, record or ack yet;
* ``before_ack`` — routing event and record handed to the connection (maybe not sent yet), the
  routing over (the name of the release that acknowledged a work-queue message here).
"""

from __future__ import annotations

import os
import signal

STEPS = ("before_decide", "after_decide", "after_publish", "after_accept", "before_ack")
#: exit status of a process killed by a fault hook (tests tell it from a crash)
FAULT_EXIT_CODE = 86

_AT = os.environ.get("KAIROS_FAULT_AT", "")
_MODE = os.environ.get("KAIROS_FAULT_MODE", "exit")
if _AT and _AT not in STEPS:
    raise SystemExit(f"KAIROS_FAULT_AT={_AT!r}: unknown step; known: {', '.join(STEPS)}")
if _MODE not in ("exit", "stop"):
    raise SystemExit(f"KAIROS_FAULT_MODE={_MODE!r}: must be exit or stop")


def armed(step: str) -> bool:
    """True when this process must die at ``step``."""
    return _AT == step


def die(step: str) -> None:
    """Exit at once (or stop, see the module docstring) if ``KAIROS_FAULT_AT`` names ``step``
    (stderr gets one line saying so)."""
    global _AT
    if _AT != step:
        return
    if _MODE == "stop":
        _AT = ""  # once: after SIGCONT this replica carries on normally
        os.write(2, f"KAIROS_FAULT_AT={step}: stopping\n".encode())
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    os.write(2, f"KAIROS_FAULT_AT={step}: exiting\n".encode())
    os._exit(FAULT_EXIT_CODE)
