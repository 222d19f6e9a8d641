//! Observability: the GPU and process monitor, and the metric sinks (JSON lines, TensorBoard,
//! Prometheus).

pub mod gpu;
pub mod history;
pub mod monitor;
pub mod prom;
pub mod tensorboard;
