//! Collective communication between role processes.
