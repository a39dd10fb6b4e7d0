"""Legs: everything sent to engines and read back (bodies, calls, D's answer, releases, calibration reads); imports intake, reuse, engines."""
