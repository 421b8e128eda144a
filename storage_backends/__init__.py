"""storage_backends: L3, bytes in and bytes out by page key (memory, file, redis, grpc).

Never imports torch: pages are bytes and memoryviews.
"""
