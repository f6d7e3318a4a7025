"""The tensor-parallel process group: which rank this process is and the collectives between ranks."""
