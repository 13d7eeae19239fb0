"""The device side: the CPU tier's memory (host pool), KV layouts, the copier between
device and CPU and its copy backends (CUDA streams, a thread pool), layer-by-layer progress."""
