"""``python -m kairos.services.profiler``: profile one decode node of a running cluster
(:mod:`kairos.services.profiler.command`; ``--help`` lists its options). The self-contained modes
(``--emulated``, ``--vllm``, ``--testbed``) are ``kairos profile``'s."""

from kairos.services.profiler.command import main

if __name__ == "__main__":
    main()
