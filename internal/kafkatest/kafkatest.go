// Package kafkatest starts in-process Kafka brokers (kfake) for tests,
// plain or secured with TLS and SASL (with the certificates they need), and
// collects what is published to them (Collector). kfake speaks the real
// wire protocol over TCP, so the clients under test do the same requests,
// TLS handshakes and SASL exchanges as against a real broker.
package kafkatest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"
)

// PKI is a certificate authority made for one test, with a server
// certificate for 127.0.0.1 and localhost and a client certificate, all
// signed by it and written as PEM files to a temporary directory.
type PKI struct {
	CAFile         string // the CA certificate
	ServerCertFile string // server certificate, valid for 127.0.0.1, ::1 and localhost
	ServerKeyFile  string
	ClientCertFile string // client certificate, for mutual TLS
	ClientKeyFile  string

	pool   *x509.CertPool
	server tls.Certificate
}

// NewPKI makes a fresh CA and its certificates in t.TempDir(). Two PKIs do
// not trust each other, which is how tests get an untrusted CA.
func NewPKI(t testing.TB) *PKI {
	t.Helper()
	dir := t.TempDir()
	p := &PKI{pool: x509.NewCertPool()}

	caKey := newKey(t)
	ca := &x509.Certificate{
		SerialNumber:          serial(t),
		Subject:               pkix.Name{CommonName: "kafkatest CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatalf("create CA certificate: %v", err)
	}
	if ca, err = x509.ParseCertificate(caDER); err != nil {
		t.Fatalf("parse CA certificate: %v", err)
	}
	p.pool.AddCert(ca)
	p.CAFile = writePEM(t, dir, "ca.pem", "CERTIFICATE", caDER)

	issue := func(name string, usage x509.ExtKeyUsage, ips []net.IP, dns []string) (certFile, keyFile string, pair tls.Certificate) {
		key := newKey(t)
		tmpl := &x509.Certificate{
			SerialNumber: serial(t),
			Subject:      pkix.Name{CommonName: "kafkatest " + name},
			NotBefore:    time.Now().Add(-time.Hour),
			NotAfter:     time.Now().Add(24 * time.Hour),
			KeyUsage:     x509.KeyUsageDigitalSignature,
			ExtKeyUsage:  []x509.ExtKeyUsage{usage},
			IPAddresses:  ips,
			DNSNames:     dns,
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			t.Fatalf("create %s certificate: %v", name, err)
		}
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			t.Fatalf("marshal %s key: %v", name, err)
		}
		certFile = writePEM(t, dir, name+".pem", "CERTIFICATE", der)
		keyFile = writePEM(t, dir, name+"-key.pem", "PRIVATE KEY", keyDER)
		pair, err = tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			t.Fatalf("load %s key pair: %v", name, err)
		}
		return certFile, keyFile, pair
	}
	// kfake listens on 127.0.0.1 and clients verify the address they dialed
	// (sarama sets ServerName to the broker's host), so the server
	// certificate names the IP addresses as well as localhost.
	p.ServerCertFile, p.ServerKeyFile, p.server = issue("server", x509.ExtKeyUsageServerAuth,
		[]net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}, []string{"localhost"})
	p.ClientCertFile, p.ClientKeyFile, _ = issue("client", x509.ExtKeyUsageClientAuth, nil, nil)
	return p
}

// ServerTLS returns a listener configuration presenting the server
// certificate. With requireClientCert the broker refuses clients without a
// certificate signed by this PKI's CA (mutual TLS).
func (p *PKI) ServerTLS(requireClientCert bool) *tls.Config {
	c := &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{p.server}}
	if requireClientCert {
		c.ClientAuth = tls.RequireAndVerifyClientCert
		c.ClientCAs = p.pool
	}
	return c
}

// User is a SASL credential a broker accepts.
type User struct {
	Mechanism string // PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512
	Name      string
	Password  string
}

// Broker describes a single-broker in-process cluster to start.
type Broker struct {
	// TLS, when set, makes the broker accept TLS connections only.
	TLS *tls.Config
	// Users, when set, makes the broker require SASL authentication with one
	// of these credentials. A user may be listed once per mechanism.
	Users []User
	// Topics are created with Partitions partitions each (default 1).
	Topics     []string
	Partitions int32
}

// Start starts the broker, stops it when the test ends and returns its
// address, 127.0.0.1:port.
func Start(t testing.TB, b Broker) string {
	t.Helper()
	c := StartCluster(t, b)
	return c.ListenAddrs()[0]
}

// StartCluster is Start returning the cluster, for tests that change it
// while it runs (users, faults).
func StartCluster(t testing.TB, b Broker) *kfake.Cluster {
	t.Helper()
	parts := b.Partitions
	if parts == 0 {
		parts = 1
	}
	opts := []kfake.Opt{kfake.NumBrokers(1)}
	if len(b.Topics) > 0 {
		opts = append(opts, kfake.SeedTopics(parts, b.Topics...))
	}
	if b.TLS != nil {
		opts = append(opts, kfake.TLS(b.TLS))
	}
	if len(b.Users) > 0 {
		// Superuser only adds a credential; EnableSASL is what makes the
		// broker refuse every request but ApiVersions and the SASL ones
		// before authentication.
		opts = append(opts, kfake.EnableSASL())
		for _, u := range b.Users {
			opts = append(opts, kfake.Superuser(u.Mechanism, u.Name, u.Password))
		}
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		t.Fatalf("start kfake: %v", err)
	}
	t.Cleanup(c.Close)
	return c
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("generate key: %v", err)
	}
	return k
}

func serial(t testing.TB) *big.Int {
	t.Helper()
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		t.Fatalf("serial number: %v", err)
	}
	return n
}

func writePEM(t testing.TB, dir, name, typ string, der []byte) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatalf("write %s: %v", path, err)
	}
	return path
}

// Collector reads every partition of some topics from their oldest offset,
// for as long as the test runs.
type Collector struct {
	mu   sync.Mutex
	msgs []*sarama.ConsumerMessage
}

// Collect starts a Collector of topics on the broker at addr; it stops when
// the test ends.
func Collect(t testing.TB, addr string, topics ...string) *Collector {
	t.Helper()
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	consumer, err := sarama.NewConsumer([]string{addr}, c)
	if err != nil {
		t.Fatal(err)
	}
	col := &Collector{}
	var wg sync.WaitGroup
	var pcs []sarama.PartitionConsumer
	for _, topic := range topics {
		parts, err := consumer.Partitions(topic)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range parts {
			pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
			if err != nil {
				t.Fatal(err)
			}
			pcs = append(pcs, pc)
			wg.Go(func() {
				for m := range pc.Messages() {
					col.mu.Lock()
					col.msgs = append(col.msgs, m)
					col.mu.Unlock()
				}
			})
		}
	}
	t.Cleanup(func() {
		// sarama wants partition consumers closed before their consumer.
		for _, pc := range pcs {
			pc.AsyncClose()
		}
		wg.Wait()
		consumer.Close()
	})
	return col
}

// Wait returns the collected messages once there are at least n, failing
// the test after within.
func (c *Collector) Wait(t testing.TB, n int, within time.Duration) []*sarama.ConsumerMessage {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		got := c.Snapshot()
		if len(got) >= n {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("got %d messages, want %d, within %v", len(got), n, within)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Snapshot returns what was collected so far.
func (c *Collector) Snapshot() []*sarama.ConsumerMessage {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*sarama.ConsumerMessage(nil), c.msgs...)
}

// Header returns the value of m's first header named key, "" if none.
func Header(m *sarama.ConsumerMessage, key string) string {
	for _, h := range m.Headers {
		if string(h.Key) == key {
			return string(h.Value)
		}
	}
	return ""
}
