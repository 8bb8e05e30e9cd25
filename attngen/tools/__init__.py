"""Measuring tools: `attngen bench` (bench, with its methods and report formats), `attngen profile`
(profile), and the FLOP counting, timing and progress display they and the tuner share (timing,
progress)."""
