"""The engine loop: scheduler, block manager, step execution with fault isolation, outputs."""
