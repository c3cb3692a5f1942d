"""Monitoring assets: the run's Grafana dashboard (built by ``python -m monitoring.dashboard``)."""
