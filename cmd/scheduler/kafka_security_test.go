package main

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/kafkaclient"
	"github.com/deferq/scheduler/internal/kafkatest"
	"github.com/deferq/scheduler/internal/pgtest"
)

const (
	secUser      = "scheduler"
	secPassword  = "svc-Secret-4711"
	secAdmin     = "admin"
	secAdminPass = "adm-Secret-0815"
	secWrongPass = "not-the-Secret-42"
)

// secureBroker starts a kfake broker that speaks TLS only and requires SASL
// SCRAM-SHA-512, with the service's user and an admin for the test's own
// clients, and returns its address and the environment that points the
// scheduler at it.
func secureBroker(t *testing.T, password string) (addr string, pki *kafkatest.PKI, env []string) {
	t.Helper()
	pki = kafkatest.NewPKI(t)
	addr = kafkatest.Start(t, kafkatest.Broker{
		TLS: pki.ServerTLS(false),
		Users: []kafkatest.User{
			{Mechanism: "SCRAM-SHA-512", Name: secUser, Password: secPassword},
			{Mechanism: "SCRAM-SHA-512", Name: secAdmin, Password: secAdminPass},
		},
		Topics: []string{deferTopic, targetTopic}, Partitions: 4,
	})
	env = []string{
		"KAFKA_TLS=true", "KAFKA_TLS_CA_FILE=" + pki.CAFile,
		"KAFKA_SASL_MECHANISM=SCRAM-SHA-512", "KAFKA_SASL_USER=" + secUser, "KAFKA_SASL_PASSWORD=" + password,
		// Later values win over serviceEnv's: a TLS handshake and a SCRAM
		// exchange under the race detector on a busy machine can take
		// longer than its 300ms, and the lease must outlast 17 of them.
		"KAFKA_TIMEOUT=1s", "LEASE_DURATION=20s",
	}
	return addr, pki, env
}

// adminConfig is a client configuration for the test's own clients, as the
// admin user, built like the service's.
func adminConfig(t *testing.T, pki *kafkatest.PKI) *sarama.Config {
	t.Helper()
	c, err := kafkaclient.Settings{
		Version: "3.6.0", ClientID: "e2e-admin", Timeout: 2 * time.Second,
		TLS: true, TLSCAFile: pki.CAFile,
		SASLMechanism: "SCRAM-SHA-512", SASLUser: secAdmin, SASLPassword: secAdminPass,
	}.Config()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// The real binary against a broker with SASL SCRAM-SHA-512 over TLS: it
// becomes ready, and a record produced to the defer topic (by a client with
// the same security) is republished to its target. When the service's
// password is then changed on the broker, the connections it holds stay up
// but /readyz, which opens a fresh one, fails naming kafka and the
// authentication.
func TestKafkaSCRAMOverTLS(t *testing.T) {
	addr, pki, secEnv := secureBroker(t, secPassword)
	db := pgtest.NewDB(t)
	p := start(t, append(serviceEnv(db.URL, addr, "e2e-security"), secEnv...))

	pc := adminConfig(t, pki)
	pc.Producer.Return.Successes = true
	pc.Producer.RequiredAcks = sarama.WaitForAll
	pc.Producer.Partitioner = sarama.NewMurmur2Partitioner
	prod, err := sarama.NewSyncProducer([]string{addr}, pc)
	if err != nil {
		t.Fatalf("test producer over TLS+SCRAM: %v", err)
	}
	defer prod.Close()
	if _, _, err := prod.SendMessage(deferRecord("order-7", "secured payload",
		"defer.target", targetTopic, "defer.delay", "0s")); err != nil {
		t.Fatalf("produce to %s: %v", deferTopic, err)
	}

	got := readSecure(t, addr, adminConfig(t, pki), 30*time.Second)
	if got.key != "order-7" || got.value != "secured payload" || got.headers["defer.id"] == "" ||
		got.headers["defer.target"] != targetTopic {
		t.Errorf("republished key %q value %q headers %v, want the record with defer.id set", got.key, got.value, got.headers)
	}
	waitReadyz(t, p, http.StatusOK, "")

	// Rotate the service's password on the broker.
	admin, err := sarama.NewClusterAdmin([]string{addr}, adminConfig(t, pki))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	res, err := admin.UpsertUserScramCredentials([]sarama.AlterUserScramCredentialsUpsert{{
		Name: secUser, Mechanism: sarama.SCRAM_MECHANISM_SHA_512, Iterations: 4096,
		Salt: []byte("e2e-salt-0123456"), Password: []byte("rotated-Secret-9"),
	}})
	if err == nil && len(res) == 1 && res[0].ErrorCode != sarama.ErrNoError {
		err = res[0].ErrorCode
	}
	if err != nil {
		t.Fatalf("change the password of %s: %v", secUser, err)
	}
	why := waitKafkaNotReady(t, p, 20*time.Second)
	want := `SASL SCRAM-SHA-512 authentication as user "scheduler" failed`
	if !strings.Contains(why, want) {
		t.Errorf("/readyz kafka failure %q does not contain %q", why, want)
	}
	if strings.Contains(p.Logs(), secPassword) {
		t.Error("the logs contain the SASL password")
	}
}

// With a wrong password the scheduler waits for Kafka, saying in its logs
// that the authentication failed (and never showing the password), and
// does not become ready.
func TestKafkaWrongPassword(t *testing.T) {
	addr, _, secEnv := secureBroker(t, secWrongPass)
	db := pgtest.NewDB(t)
	p := launch(t, append(serviceEnv(db.URL, addr, "e2e-wrong-password"), secEnv...))

	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(p.Logs(), "waiting for Kafka") {
		select {
		case <-p.Done():
			t.Fatalf("scheduler exited:\n%s", p.Logs())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no \"waiting for Kafka\" in the logs within 20s:\n%s", p.Logs())
		}
		time.Sleep(50 * time.Millisecond)
	}
	logs := p.Logs()
	for _, want := range []string{`SASL SCRAM-SHA-512 authentication as user \"scheduler\" failed`, addr} {
		if !strings.Contains(logs, want) {
			t.Errorf("logs do not contain %s:\n%s", want, logs)
		}
	}
	if strings.Contains(logs, secWrongPass) {
		t.Errorf("the logs contain the SASL password:\n%s", logs)
	}
	// /readyz answers 503 (kafka: connecting) until the credentials are fixed.
	if code, body := p.Get("/readyz"); code == http.StatusOK {
		t.Errorf("/readyz = 200 %s with a wrong password", body)
	}
}

// waitKafkaNotReady waits for /readyz to answer 503 with a kafka failure
// and returns it.
func waitKafkaNotReady(t *testing.T, p *proc, within time.Duration) string {
	t.Helper()
	deadline := time.Now().Add(within)
	var (
		code int
		body string
	)
	for time.Now().Before(deadline) {
		code, body = p.Get("/readyz")
		if code == http.StatusServiceUnavailable {
			failing, _ := readyzBody(t, body)["failing"].(map[string]any)
			if why, ok := failing["kafka"].(string); ok {
				return why
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("/readyz = %d %s, want 503 naming kafka within %v", code, body, within)
	return ""
}

// readSecure reads the first record of the target topic with conf.
func readSecure(t *testing.T, addr string, conf *sarama.Config, within time.Duration) delivery {
	t.Helper()
	consumer, err := sarama.NewConsumer([]string{addr}, conf)
	if err != nil {
		t.Fatalf("test consumer over TLS+SCRAM: %v", err)
	}
	defer consumer.Close()
	parts, err := consumer.Partitions(targetTopic)
	if err != nil {
		t.Fatal(err)
	}
	msgs := make(chan *sarama.ConsumerMessage)
	done := make(chan struct{})
	defer close(done)
	for _, part := range parts {
		pc, err := consumer.ConsumePartition(targetTopic, part, sarama.OffsetOldest)
		if err != nil {
			t.Fatal(err)
		}
		defer pc.AsyncClose()
		go func() {
			for m := range pc.Messages() {
				select {
				case msgs <- m:
				case <-done:
					return
				}
			}
		}()
	}
	select {
	case m := <-msgs:
		d := delivery{partition: m.Partition, key: string(m.Key), value: string(m.Value), headers: map[string]string{}}
		for _, h := range m.Headers {
			d.headers[string(h.Key)] = string(h.Value)
		}
		return d
	case <-time.After(within):
		t.Fatalf("nothing republished to %s within %v", targetTopic, within)
		return delivery{}
	}
}
