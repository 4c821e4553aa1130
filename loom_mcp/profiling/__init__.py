"""Profile runners: torch.profiler in a worker, rocprofv3 and nsys around a command."""
