//! TensorBoard event files.
