package ops

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/outbox-relay/outbox-relay/test/harness"
)

// testCA is a throwaway certificate authority.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newCA(t *testing.T, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// serverCert issues a certificate for 127.0.0.1.
func (ca *testCA) serverCert(t *testing.T) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "kafka test broker"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

func (ca *testCA) pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.cert)
	return p
}

// writeFile writes a file only the test's user can read and returns its
// path.
func writeFile(t *testing.T, name string, content []byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, content, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// The SASL users of the secured cluster.
const (
	scram256User, scram256Pass = "relay-256", "scram-256-Secret-Pw-8d1f"
	scram512User, scram512Pass = "relay-512", "scram-512-Secret-Pw-77aa"
	plainUser, plainPass       = "relay-plain", "plain-Secret-Pw-3c9e"
	wrongPass                  = "wrong-Secret-Pw-0b52"
)

// TLS with the broker's certificate verified against a private CA, and
// SASL PLAIN, SCRAM-SHA-256 and SCRAM-SHA-512, against a kfake cluster that
// accepts nothing else. Wrong credentials and an untrusted certificate must
// fail closed: nothing published, readiness down, a message that says what
// is wrong, and no password in any output.
func TestKafkaTLSAndSASL(t *testing.T) {
	t.Parallel()
	ca := newCA(t, "outbox-relay test CA")
	kafka := harness.StartKfakeWith(t, harness.KfakeOptions{Partitions: 3, Extra: []kfake.Opt{
		kfake.TLS(&tls.Config{Certificates: []tls.Certificate{ca.serverCert(t)}, MinVersion: tls.VersionTLS12}),
		kfake.EnableSASL(),
		kfake.Superuser("SCRAM-SHA-256", scram256User, scram256Pass),
		kfake.Superuser("SCRAM-SHA-512", scram512User, scram512Pass),
		kfake.Superuser("PLAIN", plainUser, plainPass),
	}})
	rejectPlainLikeKafka(kafka)
	caFile := writeFile(t, "ca.pem", ca.pem)
	otherCAFile := writeFile(t, "other-ca.pem", newCA(t, "some other CA").pem)
	secured := func(mech func(string, string) kgo.Opt, user, pass string) []kgo.Opt {
		return []kgo.Opt{kgo.DialTLSConfig(&tls.Config{RootCAs: ca.pool()}), mech(user, pass)}
	}
	scram256 := func(u, p string) kgo.Opt { return kgo.SASL(scram.Auth{User: u, Pass: p}.AsSha256Mechanism()) }
	scram512 := func(u, p string) kgo.Opt { return kgo.SASL(scram.Auth{User: u, Pass: p}.AsSha512Mechanism()) }
	plainMech := func(u, p string) kgo.Opt { return kgo.SASL(plain.Auth{User: u, Pass: p}.AsMechanism()) }

	// The independent client must itself need the credentials, or the
	// cluster would prove nothing.
	t.Run("cluster refuses anonymous clients", func(t *testing.T) {
		cl := harness.NewKgoClient(t, kafka.Brokers(), kgo.DialTLSConfig(&tls.Config{RootCAs: ca.pool()}))
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := kadm.NewClient(cl).ListTopics(ctx); err == nil {
			t.Fatal("the cluster answered a client without SASL")
		}
	})

	works := []struct {
		name      string
		mechanism string
		user      string
		password  string
		viaFile   bool
		consumer  []kgo.Opt
	}{
		{"SCRAM-SHA-256 password from the environment", "SCRAM-SHA-256", scram256User, scram256Pass, false, secured(scram256, scram256User, scram256Pass)},
		{"SCRAM-SHA-512 password from a file", "SCRAM-SHA-512", scram512User, scram512Pass, true, secured(scram512, scram512User, scram512Pass)},
		{"PLAIN password from the environment", "PLAIN", plainUser, plainPass, false, secured(plainMech, plainUser, plainPass)},
	}
	for _, tc := range works {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnvNoKafka(t)
			e.Brokers = kafka.Brokers()
			e.Migrate()
			args := e.Args("run", "--kafka-tls", "--kafka-tls-ca", caFile,
				"--kafka-sasl-mechanism", tc.mechanism, "--kafka-sasl-user", tc.user)
			var env []string
			if tc.viaFile {
				args = append(args, "--kafka-sasl-password-file", writeFile(t, "kafka-password", []byte(tc.password+"\n")))
			} else {
				env = append(env, "OUTBOX_RELAY_KAFKA_SASL_PASSWORD="+tc.password)
			}
			p := e.start(args, env...)
			p.WaitForOutput(t, `"message":"streaming"`, time.Minute)
			ids := insert(t, e.DB.DSN(), "order", 10)
			harness.ConsumeEventIDsWith(t, kafka.Brokers(), tc.consumer, topics, ids, time.Minute)
			base := p.AdminURL(t)
			_, slot := harness.HTTPGet(t, base+"/slot")
			_, readyz := harness.HTTPGet(t, base+"/readyz")
			for what, text := range map[string]string{"output": p.Output(), "/slot": slot, "/readyz": readyz} {
				if strings.Contains(text, tc.password) {
					t.Errorf("the SASL password appears in the relay's %s", what)
				}
			}
		})
	}

	fails := []struct {
		name     string
		args     []string
		password string
		// want are the words the error must contain, lower case.
		want []string
	}{
		// kfake drops the connection on a failed SCRAM exchange instead of
		// answering SASL_AUTHENTICATION_FAILED as Kafka does, so all the
		// relay can report is the lost connection and its advice.
		{"wrong SCRAM password", []string{"--kafka-tls-ca", caFile, "--kafka-sasl-mechanism", "SCRAM-SHA-256", "--kafka-sasl-user", scram256User},
			wrongPass, []string{"run out of available brokers", "sasl"}},
		// With Kafka's own answer (see rejectPlainLikeKafka), the broker's
		// words reach the operator.
		{"wrong PLAIN password", []string{"--kafka-tls-ca", caFile, "--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-user", plainUser},
			wrongPass, []string{"sasl authentication failed", "invalid username or password"}},
		{"untrusted broker certificate", []string{"--kafka-tls-ca", otherCAFile, "--kafka-sasl-mechanism", "SCRAM-SHA-256", "--kafka-sasl-user", scram256User},
			scram256Pass, []string{"certificate", "unknown authority"}},
	}
	for _, tc := range fails {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnvNoKafka(t)
			e.Brokers = kafka.Brokers()
			e.Migrate()
			topic := "fails-closed-" + e.Slot
			p := e.start(e.Args("run", append([]string{"--kafka-tls", "--topic", topic}, tc.args...)...), "OUTBOX_RELAY_KAFKA_SASL_PASSWORD="+tc.password)
			base := p.AdminURL(t)
			insert(t, e.DB.DSN(), "order", 3)
			// Fails closed: the error names the cause, the relay is not
			// ready (or has exited), and it never starts streaming.
			clear := func() bool {
				out := strings.ToLower(p.Output())
				for _, w := range tc.want {
					if !strings.Contains(out, w) {
						return false
					}
				}
				return true
			}
			harness.WaitFor(t, time.Minute, "an error naming "+strings.Join(tc.want, " and "), func() bool { return clear() || p.Exited() })
			if !clear() {
				t.Fatalf("the relay's output does not say %q:\n%s", tc.want, harness.LastLines(p.Output(), 20))
			}
			var readyz string
			// An authentication or certificate failure is fatal (exit 1, so
			// the supervisor restarts the relay with the fixed secret); only
			// a broker that just drops the connection leaves it retrying.
			// The process may exit between the check and the request.
			if resp, err := http.Get(base + "/readyz"); err != nil {
				if code, werr := p.Wait(30 * time.Second); werr != nil || code != 1 {
					t.Errorf("/readyz unreachable (%v) and the relay did not exit 1 (exit %d, %v)", err, code, werr)
				}
			} else {
				raw, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				code, body := resp.StatusCode, string(raw)
				if code != http.StatusServiceUnavailable {
					t.Errorf("/readyz %d %q with Kafka refusing the relay, want 503", code, body)
				}
				for _, w := range tc.want {
					if !strings.Contains(strings.ToLower(body), w) {
						t.Errorf("/readyz %q does not give the reason (%q)", body, w)
					}
				}
				readyz = body
			}
			if strings.Contains(p.Output(), `"message":"streaming"`) {
				t.Errorf("the relay started streaming without a working Kafka connection")
			}
			if si := cluster.SlotInfo(t, e.DB.Name(), e.Slot); si.Active {
				t.Errorf("the relay holds the slot although it cannot publish; a standby could not take over")
			}
			for _, secret := range []string{tc.password, scram256Pass, plainPass} {
				if strings.Contains(p.Output(), secret) || strings.Contains(readyz, secret) {
					t.Errorf("a SASL password appears in the relay's output or /readyz")
				}
			}
			// Nothing reached Kafka: the test's own topic was never even
			// created.
			adm := kadm.NewClient(harness.NewKgoClient(t, kafka.Brokers(), secured(scram256, scram256User, scram256Pass)...))
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			listed, err := adm.ListTopics(ctx)
			if err != nil {
				t.Fatalf("list topics: %v", err)
			}
			if listed.Has(topic) {
				t.Errorf("topic %s exists: the relay published without valid credentials", topic)
			}
		})
	}
}

// rejectPlainLikeKafka makes kfake answer a wrong PLAIN password as Apache
// Kafka does, with SASL_AUTHENTICATION_FAILED and a message, rather than by
// closing the connection.
func rejectPlainLikeKafka(k *harness.Kfake) {
	c := k.Cluster()
	c.ControlKey(int16(kmsg.SASLAuthenticate), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		req := kreq.(*kmsg.SASLAuthenticateRequest)
		parts := bytes.Split(req.SASLAuthBytes, []byte{0}) // PLAIN: authzid NUL user NUL password
		if len(parts) != 3 || string(parts[1]) != plainUser || string(parts[2]) == plainPass {
			return nil, nil, false // SCRAM, or the right password: kfake decides
		}
		resp := req.ResponseKind().(*kmsg.SASLAuthenticateResponse)
		resp.ErrorCode = kerr.SaslAuthenticationFailed.Code
		msg := "Authentication failed: Invalid username or password"
		resp.ErrorMessage = &msg
		return resp, nil, true
	})
}
