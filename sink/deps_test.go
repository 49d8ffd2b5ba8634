package sink_test

import (
	"os/exec"
	"strings"
	"testing"
)

// The packages that route events whatever the sink must not know Kafka:
// pipeline imported publisher for its error classes, and with it sarama,
// although its page said it knew nothing of Kafka; relay and poll imported
// publisher to make their producers and sarama to open the progress topic.
// They take a factory of sinks now (publisher.Kafka).
func TestKafkaFreePackagesImportNoKafka(t *testing.T) {
	const module = "github.com/outbox-relay/outbox-relay/"
	args := []string{"list", "-f", `{{.ImportPath}}{{range .Deps}} {{.}}{{end}}`}
	for _, pkg := range []string{"sink", "engine", "dryrun", "pipeline", "relay", "poll", "messages", "progress", "event", "lsn"} {
		args = append(args, module+pkg)
	}
	out, err := exec.Command("go", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		pkg, deps, _ := strings.Cut(line, " ")
		for _, dep := range strings.Fields(deps) {
			if strings.HasPrefix(dep, "github.com/IBM/sarama") || strings.HasPrefix(dep, "github.com/twmb/franz-go") || dep == module+"publisher" {
				t.Errorf("%s imports %s", pkg, dep)
			}
		}
	}
}
