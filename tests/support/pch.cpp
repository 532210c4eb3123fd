// The translation unit that owns the test executables' precompiled header (support/pch.hpp).
