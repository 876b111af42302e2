//! The node itself: its hardware (`discover`, GPUs through `nvml`) and its load, free disk
//! space included (`load`). The bottom room: it calls nothing of the others' (only `error`).

pub mod discover;
pub mod load;
pub mod nvml;
