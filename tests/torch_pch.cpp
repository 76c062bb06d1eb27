// The owner of the precompiled LibTorch header the LibTorch test suites reuse
// (tests/CMakeLists.txt); a program that does nothing.
int main() { return 0; }
