// How many threads a CPU build's kernels run on (specpilot/runtime/threads.py, the same rule):
// TVM_NUM_THREADS or OMP_NUM_THREADS where set, else every physical core this process may use.
// TVM's pool, unless told, takes half the logical CPUs on x86 (it assumes two hardware threads a
// core), which leaves half the cores idle on machines without SMT (most VMs and containers).
#pragma once

#include <set>
#include <string>

namespace specpilot {

// Distinct (physical id, core id) among `cpus` in /proc/cpuinfo's text; 0 where it has none.
int CoresInCpuinfo(const std::set<int>& cpus, const std::string& text);
// The CPUs a cgroup v2 cpu.max ("QUOTA PERIOD" or "max PERIOD") allows, rounded up; 0: no quota.
int QuotaCpus(const std::string& text);
// The physical cores this process may run on: its affinity set, one per core where /proc/cpuinfo
// pairs hardware threads, at most the cgroup's CPU quota.
int PhysicalCores();
// Sets TVM_NUM_THREADS to PhysicalCores() unless it or OMP_NUM_THREADS is set, once a process; TVM's pool
// reads them when it starts (its first parallel kernel, or runtime.NumThreads).
void ClaimCoresForTvm();

}  // namespace specpilot
