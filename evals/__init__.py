"""Evaluations of jaild against public benchmarks, each in a package of its own, run with its
own venv (evals/agentdojo: ``make eval-agentdojo``)."""
