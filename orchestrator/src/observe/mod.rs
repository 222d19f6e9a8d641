//! Observability: the GPU monitor, the metric sinks (JSON lines, TensorBoard, Prometheus).

pub mod tensorboard;
