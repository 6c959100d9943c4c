"""Small trace files in both shipped formats, with the quirks the readers must handle (a blank line, arrivals
out of order, zero output, a seven-digit fraction, a timestamp without a fraction)."""

MOONCAKE_SAMPLE = (
    '{"timestamp": 0, "input_length": 1030, "output_length": 6, "hash_ids": [0, 1, 2]}\n'
    "\n"
    '{"timestamp": 1500, "input_length": 600, "output_length": 0, "hash_ids": [0, 7]}\n'
    '{"timestamp": 750.5, "input_length": 10, "output_length": 3, "hash_ids": [9]}\n'
)
AZURE_SAMPLE = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:17:03.9799600,4808,10\n"
    "2023-11-16 18:17:04.0319600,3180,0\n"
    "2023-11-16 18:17:05,0,7\n"
)
