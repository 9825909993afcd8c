// Test support: kvtd as a real child process (spawned from //server:kvtd with flags, stdout and
// stderr in files under $TEST_TMPDIR, JSON log lines parsed back, killed and reaped on scope
// exit) and small file helpers, shared by the process-level tests.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kvt {
namespace test {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

inline std::string TestTmpDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// A fresh, empty directory under $TEST_TMPDIR.
inline std::string MakeDir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(TestTmpDir()) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

inline std::string WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  EXPECT_TRUE(out.good()) << path;
  return path;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

inline std::string KvtdBinary() {
  for (const char* variable : {"TEST_SRCDIR", "RUNFILES_DIR"}) {
    const char* root = std::getenv(variable);
    if (root == nullptr) continue;
    const std::string path = absl::StrCat(root, "/kvt/server/kvtd");
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  ADD_FAILURE() << "kvtd binary not found under $TEST_SRCDIR/kvt/server/kvtd";
  return "kvtd-not-found";
}

// The JSON log lines of a kvtd stderr file (non-JSON lines, e.g. gRPC's own, are skipped).
inline std::vector<nlohmann::json> JsonLines(const std::string& text) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] != '{') continue;
    nlohmann::json parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_discarded() && parsed.is_object()) lines.push_back(std::move(parsed));
  }
  return lines;
}

inline std::optional<nlohmann::json> FindLogLine(const std::string& text, const std::string& msg) {
  for (nlohmann::json& line : JsonLines(text)) {
    if (line.value("msg", "") == msg) return line;
  }
  return std::nullopt;
}

inline std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)),
                        ")");
  }
  return absl::StrCat("wait status ", status);
}

// One kvtd child process. stdout and stderr go to files in $TEST_TMPDIR; the destructor kills
// and reaps a child that is still running, and the child gets SIGKILL if this test process dies.
class KvtdProcess {
 public:
  KvtdProcess(const std::string& name, const std::vector<std::string>& flags)
      : KvtdProcess(name, KvtdBinary(), flags) {}
  // Another program under the same supervision (e.g. the Prometheus server of the telemetry
  // test); WaitForPort is kvtd's alone.
  KvtdProcess(const std::string& name, const std::string& binary,
              const std::vector<std::string>& flags) {
    static int counter = 0;
    const std::string base = absl::StrCat(TestTmpDir(), "/", name, ".", ++counter);
    stdout_path_ = base + ".stdout";
    stderr_path_ = base + ".stderr";
    std::vector<std::string> args = {binary};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    const int out_fd = open(stdout_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const int err_fd = open(stderr_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out_fd < 0 || err_fd < 0) {
      ADD_FAILURE() << "cannot create " << stdout_path_ << " / " << stderr_path_;
      return;
    }
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid == 0) {
      // Child: async-signal-safe calls only, then exec.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      signal(SIGTERM, SIG_DFL);
      signal(SIGINT, SIG_DFL);
      dup2(out_fd, STDOUT_FILENO);
      dup2(err_fd, STDERR_FILENO);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out_fd);
    close(err_fd);
    if (pid < 0) {
      ADD_FAILURE() << "fork failed: " << std::strerror(errno);
      return;
    }
    pid_ = pid;
  }

  ~KvtdProcess() {
    if (pid_ > 0 && !exit_status_.has_value()) {
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }

  KvtdProcess(const KvtdProcess&) = delete;
  KvtdProcess& operator=(const KvtdProcess&) = delete;

  pid_t pid() const { return pid_; }
  std::string Stderr() const { return ReadFile(stderr_path_); }
  std::string Stdout() const { return ReadFile(stdout_path_); }

  bool Signal(int signal_number) { return pid_ > 0 && kill(pid_, signal_number) == 0; }

  // The wait status once the process has exited; nullopt if it is still running at `timeout`.
  std::optional<int> WaitExit(milliseconds timeout) {
    const Clock::time_point end = Clock::now() + timeout;
    while (pid_ > 0 && !exit_status_.has_value()) {
      int status = 0;
      const pid_t done = waitpid(pid_, &status, WNOHANG);
      if (done == pid_) {
        exit_status_ = status;
        break;
      }
      if (done < 0 || Clock::now() >= end) break;
      std::this_thread::sleep_for(milliseconds(10));
    }
    return exit_status_;
  }

  bool Running() { return pid_ > 0 && !WaitExit(milliseconds(0)).has_value(); }

  // The port of the "listening" log line; 0 (with a test failure) if kvtd exits or never logs it.
  int WaitForPort(milliseconds timeout = milliseconds(15000)) {
    std::optional<nlohmann::json> line = WaitForLogLine("listening", timeout);
    return line ? line->value("port", 0) : 0;
  }

  // The first log line with this msg, waiting for kvtd to write it (lines logged one after the
  // other are not all there at once, above all under a sanitizer); nullopt (with a test failure)
  // if kvtd exits or never logs it.
  std::optional<nlohmann::json> WaitForLogLine(const std::string& msg,
                                               milliseconds timeout = milliseconds(15000)) {
    const Clock::time_point end = Clock::now() + timeout;
    while (Clock::now() < end) {
      if (std::optional<nlohmann::json> line = FindLogLine(Stderr(), msg)) return line;
      if (!Running()) {
        // It may have logged the line just before exiting.
        if (std::optional<nlohmann::json> line = FindLogLine(Stderr(), msg)) return line;
        ADD_FAILURE() << "kvtd exited before logging '" << msg << "' ("
                      << DescribeWaitStatus(exit_status_.value_or(-1)) << "); stderr:\n"
                      << Stderr();
        return std::nullopt;
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
    ADD_FAILURE() << "kvtd did not log '" << msg << "' within " << timeout.count()
                  << " ms; stderr:\n"
                  << Stderr();
    return std::nullopt;
  }

 private:
  std::string stdout_path_;
  std::string stderr_path_;
  pid_t pid_ = -1;
  std::optional<int> exit_status_;
};

inline std::vector<std::string> ServeFlags(const std::string& store, const std::string& listen,
                                    const std::string& grace, const std::string& deadline) {
  return {"--listen_address=" + listen, "--mapper_store=" + store, "--backend=cpu",
          "--cpu_threads=2",             "--drain_grace_seconds=" + grace,
          "--shutdown_deadline_seconds=" + deadline};
}

}  // namespace test
}  // namespace kvt
