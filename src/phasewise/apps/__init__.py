"""The apps: what runs the roles for a person (replay, demo, experiments, benchmarks, simulation, job submission)."""
