package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
)

// childKfake is the first argument that makes the bench binary serve a kfake
// cluster instead of benchmarking. The broker runs in its own process so its
// CPU is measured apart from the bench's writers and consumer, as a real
// broker's would be.
const childKfake = "child-kfake"

// runKfakeChild serves one kfake broker, prints its address on stdout and
// runs until stdin closes (the bench ended or died) or SIGTERM.
func runKfakeChild(args []string) int {
	fs := flag.NewFlagSet(childKfake, flag.ContinueOnError)
	partitions := fs.Int("partitions", 6, "default partitions of auto-created topics")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(*partitions))
	if err != nil {
		fmt.Fprintln(os.Stderr, "start kfake:", err)
		return 1
	}
	defer c.Close()
	fmt.Println(strings.Join(c.ListenAddrs(), ","))
	stdinClosed := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stdinClosed)
	}()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
	select {
	case <-stdinClosed:
	case <-sig:
	}
	return 0
}

// kfakeProcess is a kfake broker in a child process.
type kfakeProcess struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	done  chan error
	addrs []string
}

// startKfakeProcess runs this binary as a kfake broker and waits for its
// address.
func startKfakeProcess(partitions int) (*kfakeProcess, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find the bench binary: %w", err)
	}
	cmd := exec.Command(self, childKfake, "--partitions", fmt.Sprint(partitions))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start kfake process: %w", err)
	}
	p := &kfakeProcess{cmd: cmd, stdin: stdin, done: make(chan error, 1)}
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		if sc.Scan() {
			line <- sc.Text()
		}
		close(line)
		_, _ = io.Copy(io.Discard, stdout)
		p.done <- cmd.Wait()
	}()
	select {
	case l, ok := <-line:
		if !ok || l == "" {
			p.close()
			return nil, errors.New("kfake process exited before printing its address")
		}
		p.addrs = strings.Split(l, ",")
		return p, nil
	case <-time.After(30 * time.Second):
		p.close()
		return nil, errors.New("kfake process printed no address within 30 s")
	}
}

func (p *kfakeProcess) pid() int { return p.cmd.Process.Pid }

// close asks the child to stop by closing its stdin, and kills it if it
// has not exited within 10 s.
func (p *kfakeProcess) close() {
	p.stdin.Close()
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
}
