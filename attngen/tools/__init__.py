"""Measuring tools: `attngen bench` (bench, with its methods and report formats), `attngen profile`
(profile), and the FLOP counting and timing they and the tuner share (timing)."""
