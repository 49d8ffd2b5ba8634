package inboxkgo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// What Run rides out and what it returns: an outage, a cut connection, a
// rebalance or a timeout is waited out; a refusal someone has to fix is
// returned.
func TestIsRetriable(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&kgo.ErrGroupSession{Err: fmt.Errorf("unable to dial: %w", refused)}, true},
		{refused, true},
		{io.EOF, true},
		{fmt.Errorf("read: %w", io.ErrUnexpectedEOF), true},
		{context.DeadlineExceeded, true},
		{&kgo.ErrGroupSession{Err: kerr.RebalanceInProgress}, true},
		{kerr.NotCoordinator, true},
		{kerr.CoordinatorNotAvailable, true},
		{kerr.UnknownMemberID, true},
		{&kgo.ErrDataLoss{Topic: "t", Partition: 0, ConsumedTo: 10, ResetTo: 0}, true},
		{kerr.TopicAuthorizationFailed, false},
		{&kgo.ErrGroupSession{Err: kerr.GroupAuthorizationFailed}, false},
		{kerr.InvalidGroupID, false},
		{errors.New("something no one classified"), false},
	} {
		if got := isRetriable(c.err); got != c.want {
			t.Errorf("isRetriable(%v) = %t, want %t", c.err, got, c.want)
		}
	}
}
