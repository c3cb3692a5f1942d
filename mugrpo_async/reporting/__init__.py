"""Reporting: metric records and their sinks, the dry run's plan, the staleness study's aggregation."""
