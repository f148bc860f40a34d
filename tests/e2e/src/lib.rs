//! Helpers for end-to-end tests: spawn real binaries, free ports, logs per child, kill on drop.
