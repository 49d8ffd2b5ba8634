package sink_test

import (
	"os/exec"
	"strings"
	"testing"
)

// The packages that route events whatever the sink must not know Kafka:
// pipeline imported publisher for its error classes, and with it sarama,
// although its page said it knew nothing of Kafka. relay and poll join
// the list once their publish loops are the engine's.
func TestKafkaFreePackagesImportNoKafka(t *testing.T) {
	for _, pkg := range []string{"sink", "pipeline", "messages", "event", "lsn"} {
		out, err := exec.Command("go", "list", "-deps", "github.com/outbox-relay/outbox-relay/"+pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list %s: %v\n%s", pkg, err, out)
		}
		for _, dep := range strings.Fields(string(out)) {
			if strings.HasPrefix(dep, "github.com/IBM/sarama") || strings.HasPrefix(dep, "github.com/twmb/franz-go") ||
				dep == "github.com/outbox-relay/outbox-relay/publisher" {
				t.Errorf("%s imports %s", pkg, dep)
			}
		}
	}
}
