"""The ``kairos`` subcommands, one module per group (registered on the click group in
:mod:`kairos.cli.main`): :mod:`.offline` (decide, sim), :mod:`.stack` (up, demo), :mod:`.live`
(bench, trace), :mod:`.profile` (profile), :mod:`.nats` (nats-auth, nats-cluster).

Each command is a thin function: options in, checks that exit 2 naming the option, then one call
into the module that does the work (imported when the command runs, so ``kairos --help`` and the
other commands do not load the simulator, the stack supervisor or the NATS client)."""
