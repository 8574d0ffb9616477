#include "threads.h"

#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <mutex>
#include <sstream>
#include <utility>

namespace specpilot {

namespace {

std::string Trimmed(const std::string& s) {
  size_t a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

std::string Slurp(const char* path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

int CoresInCpuinfo(const std::set<int>& cpus, const std::string& text) {
  std::set<std::pair<std::string, std::string>> cores;
  int cpu = -1;
  std::string package;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = Trimmed(line.substr(0, colon)), value = Trimmed(line.substr(colon + 1));
    if (key == "processor") {
      cpu = atoi(value.c_str());
      package.clear();
    } else if (key == "physical id") {
      package = value;
    } else if (key == "core id" && cpus.count(cpu)) {
      cores.emplace(package, value);
    }
  }
  return static_cast<int>(cores.size());
}

int QuotaCpus(const std::string& text) {
  std::istringstream in(text);
  std::string quota, period;
  in >> quota >> period;
  if (quota.empty() || quota == "max" || period.empty()) return 0;
  double q = atof(quota.c_str()), p = atof(period.c_str());
  if (q < 0 || p <= 0) return 0;
  return std::max(1, static_cast<int>(std::ceil(q / p)));
}

int PhysicalCores() {
  std::set<int> cpus;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int i = 0; i < CPU_SETSIZE; ++i) {
      if (CPU_ISSET(i, &set)) cpus.insert(i);
    }
  }
  if (cpus.empty()) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    for (long i = 0; i < std::max(1L, n); ++i) cpus.insert(static_cast<int>(i));
  }
  int count = static_cast<int>(cpus.size());
  if (int cores = CoresInCpuinfo(cpus, Slurp("/proc/cpuinfo"))) count = cores;
  if (int quota = QuotaCpus(Slurp("/sys/fs/cgroup/cpu.max"))) count = std::min(count, quota);
  return std::max(1, count);
}

void ClaimCoresForTvm() {
  // once a process (setenv is not safe beside another thread's setenv); TVM's pool reads TVM_NUM_THREADS,
  // else OMP_NUM_THREADS, when it starts
  static std::once_flag once;
  std::call_once(once, [] {
    if (getenv("TVM_NUM_THREADS") != nullptr || getenv("OMP_NUM_THREADS") != nullptr) return;
    setenv("TVM_NUM_THREADS", std::to_string(PhysicalCores()).c_str(), 0);
  });
}

}  // namespace specpilot
