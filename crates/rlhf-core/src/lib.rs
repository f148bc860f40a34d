//! Core domain types.
