"""``kairos plan``: sizing a P/D cluster with the simulator, with deflection and without.

* :mod:`kairos.plan.evaluate` — one simulated cluster per point, in parallel, cached by input hash;
* :mod:`kairos.plan.search` — the searches (best split, smallest cluster, sustained rate, noise rule);
* :mod:`kairos.plan.planner` — per policy the answers, and the saving over ``pd``;
* :mod:`kairos.plan.report` — the text report and the plot; :mod:`kairos.plan.emit` — deployment files;
* :mod:`kairos.plan.live` — the workload a running stack served (``--from-live``).
"""
