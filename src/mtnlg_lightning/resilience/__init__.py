"""Self-healing long runs: exit codes that say what happened, a launcher that restarts only what a restart can fix,
hang detection, straggler reports and restarts that resume by themselves (docs/runbook.md)."""
