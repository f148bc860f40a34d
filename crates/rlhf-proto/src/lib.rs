//! Wire protocol.
