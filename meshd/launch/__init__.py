"""Runs: jobs, providers, statuses, and the smoke run."""
