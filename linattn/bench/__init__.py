"""Speed and memory benchmarks of ops (``linattn bench ops``) and decoding (``linattn bench decode``)."""
