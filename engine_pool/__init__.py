"""Engine processes, their supervisor and the node agent."""
