/* The pod sandbox's process ("pause" image), built by scripts/cluster:
 * holds the pod's namespaces, reaps the zombies of a shared process
 * namespace, and exits on SIGTERM or SIGINT. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { _exit(128 + sig); }

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction term = {.sa_handler = quit};
  struct sigaction child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGTERM, &term, NULL) || sigaction(SIGINT, &term, NULL) ||
      sigaction(SIGCHLD, &child, NULL)) {
    return 1;
  }
  for (;;) {
    pause();
  }
}
