"""The data of one request: sampling parameters, sequences, outputs, request errors."""
