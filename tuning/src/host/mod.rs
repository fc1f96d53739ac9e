//! Host tuners: see docs/operations.md.
